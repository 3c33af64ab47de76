"""openai-whisper MultiHeadAttention used as the decoder's cross-attention: query/key(no bias)/value/out,
keys and values from the audio features xa, q and k each scaled by head_dim**-0.25 on the manual
(non-SDPA) path; wrapped in the residual sub-block (cross_attn_ln + cross_attn) of a
ResidualAttentionBlock, called as block(x, xa)."""

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class LayerNorm(nn.LayerNorm):
    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x.to(self.weight.dtype)).type(x.dtype)


class Linear(nn.Linear):
    def forward(self, x: Tensor) -> Tensor:
        return F.linear(
            x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype)
        )


class MultiHeadAttention(nn.Module):
    use_sdpa = False

    def __init__(self, n_state: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.query = Linear(n_state, n_state)
        self.key = Linear(n_state, n_state, bias=False)
        self.value = Linear(n_state, n_state)
        self.out = Linear(n_state, n_state)

    def forward(
        self,
        x: Tensor,
        xa: Tensor | None = None,
        mask: Tensor | None = None,
        kv_cache: dict | None = None,
    ):
        q = self.query(x)

        if kv_cache is None or xa is None or self.key not in kv_cache:
            # hooks, if installed (i.e. kv_cache is not None), will prepend the cached kv tensors;
            # otherwise, perform key/value projections for self- or cross-attention as usual.
            k = self.key(x if xa is None else xa)
            v = self.value(x if xa is None else xa)
        else:
            # for cross-attention, calculate keys and values once and reuse in subsequent calls.
            k = kv_cache[self.key]
            v = kv_cache[self.value]

        wv, qk = self.qkv_attention(q, k, v, mask)
        return self.out(wv), qk

    def qkv_attention(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None):
        n_batch, n_ctx, n_state = q.shape
        scale = (n_state // self.n_head) ** -0.25
        q = q.view(*q.shape[:2], self.n_head, -1).permute(0, 2, 1, 3)
        k = k.view(*k.shape[:2], self.n_head, -1).permute(0, 2, 1, 3)
        v = v.view(*v.shape[:2], self.n_head, -1).permute(0, 2, 1, 3)

        qk = (q * scale) @ (k * scale).transpose(-1, -2)
        if mask is not None:
            qk = qk + mask[:n_ctx, :n_ctx]
        qk = qk.float()

        w = F.softmax(qk, dim=-1).to(q.dtype)
        out = (w @ v).permute(0, 2, 1, 3).flatten(start_dim=2)
        return out, qk.detach()


class CrossAttentionSublayer(nn.Module):
    """The cross-attention part of whisper's ResidualAttentionBlock(cross_attention=True)."""

    def __init__(self, n_state: int, n_head: int):
        super().__init__()
        self.cross_attn = MultiHeadAttention(n_state, n_head)
        self.cross_attn_ln = LayerNorm(n_state)

    def forward(self, x: Tensor, xa: Tensor, kv_cache: dict | None = None):
        return x + self.cross_attn(self.cross_attn_ln(x), xa, kv_cache=kv_cache)[0]


def make_cross_sublayer():
    return CrossAttentionSublayer(n_state=64, n_head=4)


EXPECT = {
    "target": "make_cross_sublayer",
    "kind": "cross",
    "ok": True,
    "layer": "cross_attn",
    "structure": {
        "heads": 4,
        "kv_heads": 4,
        "head_dim": 16,
        "causal": False,
        "cross": True,
        "rope": None,
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "openai-whisper MultiHeadAttention as cross_attn (key without bias, k/v from xa, q and k each * head_dim**-0.25, manual softmax path) behind cross_attn_ln",
}

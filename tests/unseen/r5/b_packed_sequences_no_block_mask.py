"""GPT block that packs the batch into one stream for a single SDPA call; bug: no block-diagonal mask, so later sequences attend to earlier ones."""

import torch.nn.functional as F
from torch import nn


class PackedCausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, bias=True):
        super().__init__()
        assert n_embd % n_head == 0
        self.n_head = n_head
        self.head_dim = n_embd // n_head
        self.q_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.k_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.v_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.o_proj = nn.Linear(n_embd, n_embd, bias=bias)

    def forward(self, x):
        B, T, C = x.shape
        # pack: (B, T, C) -> (1, B*T, C), one long causal stream ("varlen" without cu_seqlens)
        packed = x.reshape(1, B * T, C)

        def heads(t):
            return t.view(1, B * T, self.n_head, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q_proj(packed)), heads(self.k_proj(packed)), heads(self.v_proj(packed))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(B, T, C)
        return self.o_proj(y)


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = PackedCausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd)
        )

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


EXPECT = {
    "target": "Block",
    "kind": "causal-multihead",
    "ok": False,
    "stage": "scores",
    "mistake": "batch_mixing",
    "layer": "attn",
    "style": "GPT block with sequence packing for one SDPA call (no document/block-diagonal mask)",
}

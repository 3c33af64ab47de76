"""A Stanford CS336 (assignment 1, "cs336_basics") TransformerLM, extended with a book-style KV cache.

The assignment's own pieces: `Linear` (weight (d_out, d_in), truncated-normal init, no bias),
`Embedding`, `RMSNorm` (weight), `SwiGLU` (w1, w2, w3), `RotaryPositionalEmbedding(theta, d_k,
max_seq_len)` applied as `rope(x, token_positions)` to adjacent pairs (x[2i], x[2i+1]) from
precomputed cos/sin buffers, `scaled_dot_product_attention(Q, K, V, mask)` with a boolean mask
(True = attend) filled with -inf, `CausalMultiHeadSelfAttention` (q_proj, k_proj, v_proj,
output_proj; 4 heads of 16), `TransformerBlock` (ln1, attn, ln2, ffn), `TransformerLM`
(token_embeddings, layers, ln_final, lm_head).
Cache (book-buffers): `model.reset_kv_cache()`, then `model(prompt, use_cache=True)`, then
`model(tok, use_cache=True)`; each attention grows its own `k_cache`/`v_cache` (b, h, s, d) by
torch.cat and the model's `current_pos` gives the token positions.  `model(ids)` is the full forward.
Slip: forward() appends the step's keys and values to the cache and then hands one-token steps on a
non-empty cache to `_decode_step`, which appends them again (it was written to be called on its own).  The cache holds
every decoded token twice, and each decoded query already sees its own key twice.  Positions stay
right (current_pos is advanced once per call).
"""

import math
from typing import Optional

import torch
import torch.nn as nn

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["layers.0.attn", "layers.1.attn", "layers.2.attn"],
    "kind": "causal-multihead",
    "cache": "book-buffers",
    "decode": {"mistake": "cache_stale", "step": 0, "layer": "layers.0.attn"},
    "style": "Stanford CS336 assignment-1 TransformerLM (own Linear/Embedding/RMSNorm/SwiGLU, interleaved-pair RoPE "
    "with token_positions, boolean-mask scaled_dot_product_attention) + use_cache buffers; slip: one-token "
    "steps append their k/v in forward() and again in _decode_step()",
}


class Linear(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        std = math.sqrt(2.0 / (in_features + out_features))
        w = torch.empty(out_features, in_features)
        nn.init.trunc_normal_(w, mean=0.0, std=std, a=-3 * std, b=3 * std)
        self.weight = nn.Parameter(w)

    def forward(self, x):
        return torch.einsum("...i,oi->...o", x, self.weight)


class Embedding(nn.Module):
    def __init__(self, num_embeddings, embedding_dim):
        super().__init__()
        w = torch.empty(num_embeddings, embedding_dim)
        nn.init.trunc_normal_(w, mean=0.0, std=1.0, a=-3.0, b=3.0)
        self.weight = nn.Parameter(w)

    def forward(self, token_ids):
        return self.weight[token_ids]


class RMSNorm(nn.Module):
    def __init__(self, d_model, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))

    def forward(self, x):
        rms = torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x / rms * self.weight


class SwiGLU(nn.Module):
    def __init__(self, d_model, d_ff):
        super().__init__()
        self.w1 = Linear(d_model, d_ff)
        self.w2 = Linear(d_ff, d_model)
        self.w3 = Linear(d_model, d_ff)

    def forward(self, x):
        a = self.w1(x)
        return self.w2(a * torch.sigmoid(a) * self.w3(x))


class RotaryPositionalEmbedding(nn.Module):
    def __init__(self, theta, d_k, max_seq_len):
        super().__init__()
        inv = 1.0 / (theta ** (torch.arange(0, d_k, 2, dtype=torch.float64) / d_k))
        ang = torch.arange(max_seq_len, dtype=torch.float64)[:, None] * inv[None, :]
        self.register_buffer("cos", ang.cos().float(), persistent=False)
        self.register_buffer("sin", ang.sin().float(), persistent=False)

    def forward(self, x, token_positions):
        cos = self.cos[token_positions].to(x.dtype)
        sin = self.sin[token_positions].to(x.dtype)
        x_even, x_odd = x[..., 0::2], x[..., 1::2]
        out = torch.stack([x_even * cos - x_odd * sin, x_even * sin + x_odd * cos], dim=-1)
        return out.flatten(-2)


def softmax(x, dim):
    x = x - x.amax(dim=dim, keepdim=True)
    e = torch.exp(x)
    return e / e.sum(dim=dim, keepdim=True)


def scaled_dot_product_attention(Q, K, V, mask=None):
    d_k = Q.shape[-1]
    scores = torch.einsum("...qd,...kd->...qk", Q, K) / math.sqrt(d_k)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("...qk,...kd->...qd", softmax(scores, dim=-1), V)


class CausalMultiHeadSelfAttention(nn.Module):
    def __init__(self, d_model, num_heads, rope):
        super().__init__()
        self.num_heads = num_heads
        self.d_k = d_model // num_heads
        self.q_proj = Linear(d_model, d_model)
        self.k_proj = Linear(d_model, d_model)
        self.v_proj = Linear(d_model, d_model)
        self.output_proj = Linear(d_model, d_model)
        self.rope = rope
        self.k_cache: Optional[torch.Tensor] = None
        self.v_cache: Optional[torch.Tensor] = None

    def reset_cache(self):
        self.k_cache, self.v_cache = None, None

    def _append_kv(self, k, v):
        if self.k_cache is None:
            self.k_cache, self.v_cache = k, v
        else:
            self.k_cache = torch.cat([self.k_cache, k], dim=2)
            self.v_cache = torch.cat([self.v_cache, v], dim=2)

    def _heads(self, x):
        b, s, _ = x.shape
        return x.view(b, s, self.num_heads, self.d_k).transpose(1, 2)

    def _merge(self, x):
        b, h, s, d = x.shape
        return x.transpose(1, 2).reshape(b, s, h * d)

    def _decode_step(self, q, k_new, v_new):
        self._append_kv(k_new, v_new)
        out = scaled_dot_product_attention(q, self.k_cache, self.v_cache)
        return self.output_proj(self._merge(out))

    def forward(self, x, token_positions, use_cache=False):
        seq_len = x.shape[1]
        q, k, v = (
            self._heads(self.q_proj(x)),
            self._heads(self.k_proj(x)),
            self._heads(self.v_proj(x)),
        )
        q = self.rope(q, token_positions)
        k = self.rope(k, token_positions)
        if use_cache:
            had_cache = self.k_cache is not None
            self._append_kv(k, v)
            if seq_len == 1 and had_cache:
                return self._decode_step(q, k, v)
            k, v = self.k_cache, self.v_cache
        n_keys = k.shape[2]
        mask = torch.ones(seq_len, n_keys, dtype=torch.bool, device=x.device).tril(
            diagonal=n_keys - seq_len
        )
        out = scaled_dot_product_attention(q, k, v, mask)
        return self.output_proj(self._merge(out))


class TransformerBlock(nn.Module):
    def __init__(self, d_model, num_heads, d_ff, rope):
        super().__init__()
        self.ln1 = RMSNorm(d_model)
        self.attn = CausalMultiHeadSelfAttention(d_model, num_heads, rope)
        self.ln2 = RMSNorm(d_model)
        self.ffn = SwiGLU(d_model, d_ff)

    def forward(self, x, token_positions, use_cache=False):
        x = x + self.attn(self.ln1(x), token_positions, use_cache=use_cache)
        return x + self.ffn(self.ln2(x))


class TransformerLM(nn.Module):
    def __init__(
        self,
        vocab_size=150,
        context_length=64,
        d_model=64,
        num_layers=3,
        num_heads=4,
        d_ff=176,
        rope_theta=10000.0,
    ):
        super().__init__()
        rope = RotaryPositionalEmbedding(rope_theta, d_model // num_heads, context_length)
        self.token_embeddings = Embedding(vocab_size, d_model)
        self.layers = nn.ModuleList(
            [TransformerBlock(d_model, num_heads, d_ff, rope) for _ in range(num_layers)]
        )
        self.ln_final = RMSNorm(d_model)
        self.lm_head = Linear(d_model, vocab_size)
        self.current_pos = 0

    def reset_kv_cache(self):
        self.current_pos = 0
        for layer in self.layers:
            layer.attn.reset_cache()

    def forward(self, in_indices, use_cache=False):
        seq_len = in_indices.shape[1]
        start = self.current_pos if use_cache else 0
        token_positions = torch.arange(start, start + seq_len, device=in_indices.device)
        x = self.token_embeddings(in_indices)
        for layer in self.layers:
            x = layer(x, token_positions, use_cache=use_cache)
        if use_cache:
            self.current_pos += seq_len
        return self.lm_head(self.ln_final(x))


def make_model():
    torch.manual_seed(810)
    model = TransformerLM()
    g = torch.Generator().manual_seed(8101)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

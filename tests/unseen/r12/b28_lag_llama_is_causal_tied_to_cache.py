"""time-series-foundation-models/lag-llama style CausalSelfAttention inside a one-block LagLlamaModel
(transformer = ModuleDict(wte, h, ln_f), RMSNorm with a learned scale): q_proj and a fused kv_proj
(2 * n_embd) split with .split(n_embd, dim=2), heads via view(B, -1, n_head, head_dim), a
LlamaRotaryEmbedding with cached cos/sin buffers (cat(freqs, freqs)) applied with rotate_half after the
transpose to (B, nh, T, hs), F.scaled_dot_product_attention with is_causal=True when no key/value cache
is in use, transpose/view back and c_proj.

This file's one bug: lag-llama CausalSelfAttention: the two SDPA branches merged into one call with
is_causal=use_kv_cache and not cache_initialized, which is False in a plain forward (no cache), so
the model sees the future."""

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, size, dim=-1, eps=1e-5):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.dim = dim

    def forward(self, x):
        norm_x = x.pow(2).mean(dim=self.dim, keepdim=True)
        x_normed = x * torch.rsqrt(norm_x + self.eps)
        return self.scale * x_normed


class LlamaRotaryEmbedding(nn.Module):
    def __init__(self, dim, max_position_embeddings=2048, base=10000):
        super().__init__()
        self.dim = dim
        self.base = base
        inv_freq = 1.0 / (
            self.base ** (torch.arange(0, self.dim, 2, dtype=torch.float64) / self.dim)
        )
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._set_cos_sin_cache(max_position_embeddings)

    def _set_cos_sin_cache(self, seq_len):
        self.max_seq_len_cached = seq_len
        t = torch.arange(self.max_seq_len_cached, dtype=torch.float64)
        freqs = torch.einsum("i,j->ij", t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos()[None, None, :, :], persistent=False)
        self.register_buffer("sin_cached", emb.sin()[None, None, :, :], persistent=False)

    def forward(self, x, seq_len=None):
        if seq_len > self.max_seq_len_cached:
            self._set_cos_sin_cache(seq_len)
        return (
            self.cos_cached[:, :, :seq_len, ...].to(dtype=x.dtype),
            self.sin_cached[:, :, :seq_len, ...].to(dtype=x.dtype),
        )


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None):
    if position_ids is not None:
        cos = cos.squeeze(1).squeeze(0)[position_ids].unsqueeze(1)
        sin = sin.squeeze(1).squeeze(0)[position_ids].unsqueeze(1)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, block_size):
        super().__init__()
        self.q_proj = nn.Linear(n_embd, n_embd, bias=False)
        self.kv_proj = nn.Linear(n_embd, 2 * n_embd, bias=False)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=False)
        self.n_head = n_head
        self.n_embd = n_embd
        self.head_dim = n_embd // n_head
        self.block_size = block_size
        self.rotary_emb = LlamaRotaryEmbedding(self.head_dim, max_position_embeddings=block_size)
        self.kv_cache = None

    def forward(self, x, use_kv_cache=False):
        B, T, C = x.size()
        q = self.q_proj(x)
        k, v = self.kv_proj(x).split(self.n_embd, dim=2)
        cache_initialized = self.kv_cache is not None
        k = k.view(B, -1, self.n_head, self.head_dim)
        q = q.view(B, -1, self.n_head, self.head_dim)
        v = v.view(B, -1, self.n_head, self.head_dim)
        k = k.transpose(1, 2)
        q = q.transpose(1, 2)
        v = v.transpose(1, 2)
        true_seq_len = k.shape[2]
        cos, sin = self.rotary_emb(v, seq_len=true_seq_len)
        q, k = apply_rotary_pos_emb(q, k, cos, sin, position_ids=None)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=None, dropout_p=0.0, is_causal=use_kv_cache and not cache_initialized
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, n_embd):
        super().__init__()
        self.c_fc1 = nn.Linear(n_embd, 2 * n_embd, bias=False)
        self.c_fc2 = nn.Linear(n_embd, 2 * n_embd, bias=False)
        self.c_proj = nn.Linear(2 * n_embd, n_embd, bias=False)

    def forward(self, x):
        return self.c_proj(F.silu(self.c_fc1(x)) * self.c_fc2(x))


class Block(nn.Module):
    def __init__(self, n_embd, n_head, block_size):
        super().__init__()
        self.rms_1 = RMSNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, block_size)
        self.rms_2 = RMSNorm(n_embd)
        self.mlp = MLP(n_embd)

    def forward(self, x, use_kv_cache=False):
        x = x + self.attn(self.rms_1(x), use_kv_cache)
        return x + self.mlp(self.rms_2(x))


class LagLlamaModel(nn.Module):
    def __init__(self, feature_size=64, n_embd=64, n_head=4, n_layer=1, block_size=128):
        super().__init__()
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Linear(feature_size, n_embd),
                h=nn.ModuleList([Block(n_embd, n_head, block_size) for _ in range(n_layer)]),
                ln_f=RMSNorm(n_embd),
            )
        )

    def forward(self, x, use_kv_cache=False):
        x = self.transformer.wte(x)
        for block in self.transformer.h:
            x = block(x, use_kv_cache)
        return self.transformer.ln_f(x)


def make_lag_llama():
    torch.manual_seed(1210)
    model = LagLlamaModel()
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, RMSNorm):
                mod.scale.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {
    "target": "make_lag_llama",
    "kind": "causal-multihead",
    "ok": False,
    "layer": "transformer.h.0.attn",
    "stage": "masked_scores",
    "mistake": "missing_mask",
    "style": "lag-llama CausalSelfAttention: the two SDPA branches merged into one call with "
    "is_causal=use_kv_cache and not cache_initialized, which is False in a plain forward (no "
    "cache), so the model sees the future",
}

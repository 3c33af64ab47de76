"""flash-attn style MHA (Wqkv -> q | packed kv with num_heads_kv=2, rearranges, RotaryEmbedding with
rotary_emb_dim = head_dim in non-interleaved (halves) mode on (B, T, H, D)) whose local attention follows
flash-attn's window_size=(left, right) semantics in a torch fallback (keys in [i - left, i + right]); the
layer reads a Mistral-style config.sliding_window=4 and passes window_size=(sliding_window - 1, 0), as
transformers does since its flash off-by-one fix.  Inside a pre-norm Block as `mixer`."""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange, repeat


def rotate_half(x, interleaved=False):
    if not interleaved:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return rearrange(torch.stack((-x2, x1), dim=-1), "... d two -> ... (d two)", two=2)


def apply_rotary_emb_torch(x, cos, sin, interleaved=False):
    """x: (batch_size, seqlen, nheads, headdim); cos, sin: (seqlen, rotary_dim / 2)"""
    ro_dim = cos.shape[-1] * 2
    assert ro_dim <= x.shape[-1]
    cos = repeat(cos, "... d -> ... 1 (2 d)" if not interleaved else "... d -> ... 1 (d 2)")
    sin = repeat(sin, "... d -> ... 1 (2 d)" if not interleaved else "... d -> ... 1 (d 2)")
    return torch.cat(
        [x[..., :ro_dim] * cos + rotate_half(x[..., :ro_dim], interleaved) * sin, x[..., ro_dim:]],
        dim=-1,
    )


class RotaryEmbedding(nn.Module):
    def __init__(self, dim: int, base=10000.0, interleaved=False, device=None):
        super().__init__()
        self.dim = dim
        self.base = float(base)
        self.interleaved = interleaved
        inv_freq = 1.0 / (
            self.base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
        )
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._seq_len_cached = 0
        self._cos_cached = None
        self._sin_cached = None

    def _update_cos_sin_cache(self, seqlen, device=None, dtype=None):
        if seqlen > self._seq_len_cached or self._cos_cached.dtype != dtype:
            self._seq_len_cached = seqlen
            t = torch.arange(seqlen, device=device, dtype=torch.float32)
            freqs = torch.outer(t, self.inv_freq.to(device=t.device, dtype=torch.float32))
            self._cos_cached = torch.cos(freqs).to(dtype)
            self._sin_cached = torch.sin(freqs).to(dtype)

    def forward(self, q, kv, seqlen_offset=0):
        """q: (batch, seqlen, nheads, headdim); kv: (batch, seqlen, 2, nheads_kv, headdim)"""
        seqlen = q.shape[1]
        self._update_cos_sin_cache(seqlen + seqlen_offset, device=q.device, dtype=q.dtype)
        cos = self._cos_cached[seqlen_offset : seqlen_offset + seqlen]
        sin = self._sin_cached[seqlen_offset : seqlen_offset + seqlen]
        q = apply_rotary_emb_torch(q, cos, sin, self.interleaved)
        k = apply_rotary_emb_torch(kv[:, :, 0], cos, sin, self.interleaved)
        return q, torch.stack([k, kv[:, :, 1]], dim=2)


def construct_local_mask(seqlen_q, seqlen_k, window_size=(-1, -1), device=None):
    """True where the key is outside [i - window_size[0], i + window_size[1]] (bottom-right aligned)."""
    row_idx = rearrange(torch.arange(seqlen_q, device=device, dtype=torch.long), "s -> s 1")
    col_idx = torch.arange(seqlen_k, device=device, dtype=torch.long)
    sk = seqlen_k
    if window_size[0] < 0:
        return col_idx > row_idx + sk - seqlen_q + window_size[1]
    sk = torch.full_like(col_idx, seqlen_k)
    return torch.logical_or(
        col_idx > torch.minimum(row_idx + sk - seqlen_q + window_size[1], sk),
        col_idx < row_idx + sk - seqlen_q - window_size[0],
    )


class LocalCrossAttention(nn.Module):
    """torch stand-in for flash_attn_kvpacked_func(q, kv, causal=..., window_size=...)."""

    def __init__(self, causal=True, softmax_scale=None, window_size=(-1, -1)):
        super().__init__()
        self.causal = causal
        self.softmax_scale = softmax_scale
        self.window_size = window_size

    def forward(self, q, kv):
        batch_size, seqlen_q = q.shape[0], q.shape[1]
        seqlen_k = kv.shape[1]
        if kv.shape[3] != q.shape[2]:  # MQA/GQA
            kv = repeat(kv, "... hkv d -> ... (hkv g) d", g=q.shape[2] // kv.shape[3])
        k, v = kv.unbind(dim=2)
        softmax_scale = self.softmax_scale or 1.0 / math.sqrt(q.shape[-1])
        scores = torch.einsum("bthd,bshd->bhts", q, k * softmax_scale)
        window_size = self.window_size
        if self.causal:
            window_size = (window_size[0], 0)
        local_mask = construct_local_mask(seqlen_q, seqlen_k, window_size, device=q.device)
        scores = scores.masked_fill(local_mask, float("-inf"))
        attention = torch.softmax(scores, dim=-1, dtype=v.dtype)
        return torch.einsum("bhts,bshd->bthd", attention, v)


class MHA(nn.Module):
    def __init__(
        self,
        embed_dim,
        num_heads,
        num_heads_kv=None,
        causal=True,
        rotary_emb_dim=0,
        rotary_emb_base=10000.0,
        rotary_emb_interleaved=False,
        window_size=(-1, -1),
    ):
        super().__init__()
        self.embed_dim = embed_dim
        self.causal = causal
        self.num_heads = num_heads
        self.num_heads_kv = num_heads_kv if num_heads_kv is not None else num_heads
        assert self.num_heads % self.num_heads_kv == 0, (
            "num_heads must be divisible by num_heads_kv"
        )
        self.head_dim = self.embed_dim // num_heads
        qkv_dim = self.head_dim * (self.num_heads + 2 * self.num_heads_kv)
        self.rotary_emb_dim = rotary_emb_dim
        if self.rotary_emb_dim > 0:
            self.rotary_emb = RotaryEmbedding(
                self.rotary_emb_dim, base=rotary_emb_base, interleaved=rotary_emb_interleaved
            )
        self.Wqkv = nn.Linear(embed_dim, qkv_dim, bias=True)
        self.inner_cross_attn = LocalCrossAttention(causal=causal, window_size=window_size)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=True)

    def forward(self, x):
        qkv = self.Wqkv(x)
        q = qkv[..., : self.num_heads * self.head_dim]
        kv = qkv[..., self.num_heads * self.head_dim :]
        q = rearrange(q, "... (h d) -> ... h d", d=self.head_dim)
        kv = rearrange(kv, "... (two hkv d) -> ... two hkv d", two=2, d=self.head_dim)
        if self.rotary_emb_dim > 0:
            q, kv = self.rotary_emb(q, kv)
        context = self.inner_cross_attn(q, kv)
        return self.out_proj(rearrange(context, "... h d -> ... (h d)"))


class Mlp(nn.Module):
    def __init__(self, in_features, hidden_features):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.fc2 = nn.Linear(hidden_features, in_features)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-norm block: returns (hidden_states, residual) like flash-attn's Block."""

    def __init__(self, dim, mixer, mlp):
        super().__init__()
        self.mixer = mixer
        self.norm1 = nn.LayerNorm(dim)
        self.mlp = mlp
        self.norm2 = nn.LayerNorm(dim)

    def forward(self, hidden_states, residual=None):
        residual = hidden_states + residual if residual is not None else hidden_states
        hidden_states = self.mixer(self.norm1(residual))
        residual = hidden_states + residual
        hidden_states = self.mlp(self.norm2(residual))
        return hidden_states, residual


def make_block(config=None):
    config = config or SimpleNamespace(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=4,
        rope_theta=10000.0,
    )
    head_dim = config.hidden_size // config.num_attention_heads
    # transformers' flash path: window_size=(sliding_window - 1, sliding_window - 1), causal=True
    window_size = (config.sliding_window - 1, config.sliding_window - 1)
    mixer = MHA(
        config.hidden_size,
        config.num_attention_heads,
        num_heads_kv=config.num_key_value_heads,
        causal=True,
        rotary_emb_dim=head_dim,
        rotary_emb_base=config.rope_theta,
        window_size=window_size,
    )
    mixer.config = config
    return Block(config.hidden_size, mixer, Mlp(config.hidden_size, 4 * config.hidden_size))


EXPECT = {
    "target": "make_block",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "mixer",
    "structure": {
        "heads": 4,
        "kv_heads": 2,
        "head_dim": 16,
        "causal": True,
        "cross": False,
        "rope": {"pairing": "half", "fraction": 1.0, "base": 10000.0},
        "qk_norm": None,
        "window": 4,
        "bias": None,
    },
    "style": "flash-attn MHA/Block (Wqkv -> q + '(two hkv d)' kv, RotaryEmbedding non-interleaved, kv repeat '(hkv g)') with a torch window_size=(left, right) fallback; config.sliding_window=4 -> window_size=(3, 3) with causal",
}

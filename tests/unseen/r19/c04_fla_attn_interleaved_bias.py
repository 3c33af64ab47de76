"""fla-org/flash-linear-attention `fla.layers.attn.Attention` (the softmax-attention layer used in fla's
hybrid models) in plain torch: `q_proj`/`k_proj`/`v_proj`/`o_proj`, einops-style `... (h d) -> ... h d`
head split, optional per-head `q_norm`/`k_norm` (fla `RMSNorm(head_dim)`), fla's `RotaryEmbedding`
(cos/sin cache, `interleaved` switch) applied to `(b, t, h, d)` tensors with `seqlen_offset`, and a
plain-torch stand-in for `flash_attn_func(q, k, v, causal=True, window_size=...)` with flash-attn's
`(left, right)` window convention (GQA by expanding the kv heads, as flash-attn does internally). The
layer returns fla's `(o, attentions, past_key_values)` tuple.

This file: correct (multi-head 4x16, q/k/v biases, interleaved rotary pairs, base 50000, no window)."""

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x):
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x * rstd * self.weight


def rotate_half(x, interleaved=False):
    if not interleaved:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rotary_emb_torch(x, cos, sin, interleaved=False):
    """x: (b, t, h, d); cos, sin: (t, rotary_dim / 2)"""
    ro_dim = cos.shape[-1] * 2
    if interleaved:
        cos = cos.repeat_interleave(2, dim=-1)
        sin = sin.repeat_interleave(2, dim=-1)
    else:
        cos = torch.cat((cos, cos), dim=-1)
        sin = torch.cat((sin, sin), dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    rotated = x[..., :ro_dim] * cos + rotate_half(x[..., :ro_dim], interleaved) * sin
    return torch.cat((rotated, x[..., ro_dim:]), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, base=10000.0, interleaved=False):
        super().__init__()
        self.dim = dim
        self.base = float(base)
        self.interleaved = interleaved
        inv_freq = 1.0 / (self.base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._seq_len_cached = 0
        self._cos_cached = None
        self._sin_cached = None

    def _update_cos_sin_cache(self, seqlen, dtype):
        if self._cos_cached is None or seqlen > self._seq_len_cached or self._cos_cached.dtype != dtype:
            self._seq_len_cached = seqlen
            t = torch.arange(seqlen, dtype=torch.float64)
            freqs = torch.outer(t, self.inv_freq)
            self._cos_cached = torch.cos(freqs).to(dtype)
            self._sin_cached = torch.sin(freqs).to(dtype)

    def forward(self, q, k, seqlen_offset=0, max_seqlen=None):
        seqlen = q.shape[1]
        self._update_cos_sin_cache(max_seqlen or seqlen + seqlen_offset, q.dtype)
        cos = self._cos_cached[seqlen_offset:seqlen_offset + seqlen]
        sin = self._sin_cached[seqlen_offset:seqlen_offset + seqlen]
        q = apply_rotary_emb_torch(q, cos, sin, self.interleaved)
        k = apply_rotary_emb_torch(k, cos, sin, self.interleaved)
        return q, k


def flash_attn_func(q, k, v, causal=False, window_size=(-1, -1), softmax_scale=None):
    """Plain-torch stand-in for flash_attn_func on (b, t, h, d) tensors."""
    b, tq, hq, d = q.shape
    tk, hk = k.shape[1], k.shape[2]
    if softmax_scale is None:
        softmax_scale = d ** -0.5
    if hq != hk:
        k = k.repeat_interleave(hq // hk, dim=2)
        v = v.repeat_interleave(hq // hk, dim=2)
    scores = torch.einsum("bthd,bshd->bhts", q, k) * softmax_scale
    qi = torch.arange(tq, device=q.device)[:, None] + (tk - tq)
    kj = torch.arange(tk, device=q.device)[None, :]
    visible = torch.ones(tq, tk, dtype=torch.bool, device=q.device)
    if causal:
        visible &= kj <= qi
    left, right = window_size
    if left >= 0:
        visible &= kj >= qi - left
    if right >= 0:
        visible &= kj <= qi + right
    scores = scores.masked_fill(~visible, float("-inf"))
    p = torch.softmax(scores, dim=-1)
    return torch.einsum("bhts,bshd->bthd", p, v)


class Attention(nn.Module):
    def __init__(self, hidden_size=64, num_heads=4, num_kv_heads=None, qkv_bias=False, qk_norm=False,
                 window_size=None, rope_theta=10000.0, rope_interleaved=False, layer_idx=None):
        super().__init__()
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads if num_kv_heads is not None else num_heads
        self.num_kv_groups = num_heads // self.num_kv_heads
        self.head_dim = hidden_size // num_heads
        self.kv_dim = self.num_kv_heads * self.head_dim
        self.qkv_bias = qkv_bias
        self.qk_norm = qk_norm
        self.window_size = window_size
        self.rope_theta = rope_theta
        self.layer_idx = layer_idx

        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden_size, self.kv_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden_size, self.kv_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim)
            self.k_norm = RMSNorm(self.head_dim)
        self.rotary = RotaryEmbedding(dim=self.head_dim, base=rope_theta, interleaved=rope_interleaved)

    def forward(self, hidden_states, attention_mask=None, past_key_values=None, output_attentions=False):
        batch_size, q_len, _ = hidden_states.size()
        q = self.q_proj(hidden_states).unflatten(-1, (-1, self.head_dim))
        k = self.k_proj(hidden_states).unflatten(-1, (-1, self.head_dim))
        v = self.v_proj(hidden_states).unflatten(-1, (-1, self.head_dim))

        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)

        seqlen_offset, max_seqlen = 0, q_len
        q, k = self.rotary(q, k, seqlen_offset=seqlen_offset, max_seqlen=max_seqlen + seqlen_offset)

        o = flash_attn_func(
            q, k, v,
            causal=True,
            window_size=(-1, -1) if self.window_size is None else (self.window_size - 1, 0),
        )
        o = o.reshape(batch_size, q_len, -1)
        o = self.o_proj(o)
        return o, None, past_key_values


def make_fla_interleaved():
    torch.manual_seed(1932)
    layer = Attention(hidden_size=64, num_heads=4, qkv_bias=True, rope_theta=50000.0, rope_interleaved=True)
    with torch.no_grad():
        for mod in layer.modules():
            if isinstance(mod, RMSNorm):
                mod.weight.uniform_(0.5, 1.5)
    return layer.eval()


EXPECT = {'target': 'make_fla_interleaved',
 'kind': 'causal-multihead',
 'ok': True,
 'layer': '',
 'structure': {'heads': 4,
               'kv_heads': 4,
               'head_dim': 16,
               'causal': True,
               'cross': False,
               'rope': {'pairing': 'interleaved', 'fraction': 1.0, 'base': 50000},
               'qk_norm': None,
               'window': None,
               'bias': None},
 'style': 'fla-org flash-linear-attention Attention: correct, MHA with qkv_bias, interleaved '
          'rotary base 50000, no window'}

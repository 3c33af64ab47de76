"""modded-nanogpt (KellerJordan's speedrun GPT) CausalSelfAttention, in plain torch: one stacked
`qkvo_w` parameter (4, hdim, dim) used through F.linear, `.view(B, T, 3 * H, D).chunk(3, dim=-2)`,
weight-free functional RMSNorm on queries and keys (`norm(x) = F.rms_norm(x, (x.size(-1),))`), a
cached `Rotary` on (B, T, H, D) tensors (halves), and a dense stand-in for flex_attention's BlockMask
(`mask_mod(b, h, q_idx, kv_idx)` with causal and sliding-window terms).

This file: one bug: the rotary is mapped over (q, k, v), so the values are rotated too"""

import torch
from torch import nn
import torch.nn.functional as F


def norm(x):
    return F.rms_norm(x, (x.size(-1),))


class Rotary(nn.Module):
    def __init__(self, dim, max_seq_len, base):
        super().__init__()
        angular_freq = (1.0 / base) ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        t = torch.arange(max_seq_len, dtype=torch.float64)
        theta = torch.outer(t, angular_freq)
        self.register_buffer("cos", theta.cos(), persistent=False)
        self.register_buffer("sin", theta.sin(), persistent=False)

    def forward(self, x_BTHD):
        T = x_BTHD.size(-3)
        cos = self.cos[None, :T, None, :].to(x_BTHD.dtype)
        sin = self.sin[None, :T, None, :].to(x_BTHD.dtype)
        x1, x2 = x_BTHD.chunk(2, dim=-1)
        y1 = x1 * cos - x2 * sin
        y2 = x1 * sin + x2 * cos
        return torch.cat((y1, y2), dim=-1)


def flex_attention_dense(q, k, v, mask_mod, scale):
    """What flex_attention computes for a BlockMask built from `mask_mod`, written densely."""
    T, S = q.size(-2), k.size(-2)
    q_idx = torch.arange(T, device=q.device)[:, None]
    kv_idx = torch.arange(S, device=q.device)[None, :]
    allowed = mask_mod(0, 0, q_idx, kv_idx)
    s = (q @ k.transpose(-2, -1)) * scale
    s = s.masked_fill(~allowed, float("-inf"))
    # a query row with no visible key gets zeros from flex_attention, not NaN
    p = torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)
    return p @ v


class CausalSelfAttention(nn.Module):
    def __init__(self, dim, num_heads, max_seq_len, sliding_window=None, rope_base=1024):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        hdim = num_heads * self.head_dim
        std = 0.5 * (dim ** -0.5)
        bound = (3 ** 0.5) * std
        self.qkvo_w = nn.Parameter(torch.empty(4, hdim, dim).uniform_(-bound, bound))
        self.rotary = Rotary(self.head_dim, max_seq_len, rope_base)
        self.sliding_window = sliding_window

    def mask_mod(self, b, h, q_idx, kv_idx):
        causal_mask = q_idx >= kv_idx
        if self.sliding_window is None:
            return causal_mask
        window_mask = q_idx - kv_idx < self.sliding_window
        return causal_mask & window_mask

    def forward(self, x):
        B, T = x.size(0), x.size(1)
        q, k, v = (
            F.linear(x, self.qkvo_w[:3].flatten(end_dim=1).type_as(x))
            .view(B, T, 3 * self.num_heads, self.head_dim)
            .chunk(3, dim=-2)
        )
        q, k = norm(q), norm(k)
        q, k, v = self.rotary(q), self.rotary(k), self.rotary(v)
        y = flex_attention_dense(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            self.mask_mod, scale=self.head_dim ** -0.5,
        )
        y = y.transpose(1, 2).contiguous().view(B, T, self.num_heads * self.head_dim)
        return F.linear(y, self.qkvo_w[3].type_as(y))


def make_modded_attn():
    torch.manual_seed(1706)
    attn = CausalSelfAttention(64, 4, 64, sliding_window=None, rope_base=1024.0)
    return attn.eval()


EXPECT = {'target': 'make_modded_attn',
 'kind': 'causal-multihead',
 'ok': False,
 'layer': '',
 'stage': 'values',
 'mistake': 'rope_on_values',
 'style': 'modded-nanogpt CausalSelfAttention: one bug: the rotary is mapped over (q, k, v), so '
          'the values are rotated too'}

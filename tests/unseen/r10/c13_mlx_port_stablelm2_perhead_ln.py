"""A torch port of an mlx-lm StableLM-2 attention (mlx idioms kept: nn.RoPE(dims, traditional,
base) and a scaled_dot_product_attention(q, k, v, scale, mask="causal") helper), from scratch.

partial_rotary_factor 0.25 (4 of 16 dims, traditional=False: halves), base 10000, GQA 4:2 with
the kv heads repeated inside the sdpa helper, and StableLM-2's qk_layernorm: a separate
bias-free LayerNorm per head (LayerNormPerHead), applied before the rotary.
"""

import torch
from torch import nn


class RoPE(nn.Module):
    """mlx.nn.RoPE: rotates the first `dims` features; traditional=True pairs adjacent features."""

    def __init__(self, dims, traditional=False, base=10000.0):
        super().__init__()
        self.dims = dims
        self.traditional = traditional
        self.base = base

    def forward(self, x, offset=0):
        # x: (B, H, L, D)
        L = x.shape[-2]
        inv = self.base ** (-torch.arange(0, self.dims, 2, dtype=torch.float64) / self.dims)
        theta = (torch.arange(offset, offset + L, dtype=torch.float64)[:, None] * inv).to(x.dtype)
        cos, sin = theta.cos(), theta.sin()
        xr, xp = x[..., : self.dims], x[..., self.dims :]
        if self.traditional:
            x1, x2 = xr[..., 0::2], xr[..., 1::2]
            rx = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
        else:
            x1, x2 = xr[..., : self.dims // 2], xr[..., self.dims // 2 :]
            rx = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
        return torch.cat([rx, xp], dim=-1)


def scaled_dot_product_attention(queries, keys, values, scale, mask=None):
    n_rep = queries.shape[1] // keys.shape[1]
    if n_rep > 1:
        keys = keys.repeat_interleave(n_rep, dim=1)
        values = values.repeat_interleave(n_rep, dim=1)
    scores = (queries * scale) @ keys.transpose(-1, -2)
    if isinstance(mask, str) and mask == "causal":
        L, S = scores.shape[-2:]
        keep = torch.arange(S)[None, :] <= torch.arange(L)[:, None] + (S - L)
        scores = torch.where(keep, scores, torch.finfo(scores.dtype).min)
    return torch.softmax(scores, dim=-1) @ values


class LayerNormPerHead(nn.Module):
    def __init__(self, head_dim, num_heads, eps):
        super().__init__()
        self.norms = nn.ModuleList(
            [nn.LayerNorm(head_dim, eps=eps, bias=False) for _ in range(num_heads)]
        )

    def forward(self, x):
        # x: (B, L, H, D)
        return torch.stack([norm(x[:, :, i]) for i, norm in enumerate(self.norms)], dim=2)


class Attention(nn.Module):
    def __init__(
        self, hidden_size=64, num_heads=4, num_kv_heads=2, partial_rotary_factor=0.25, eps=1e-5
    ):
        super().__init__()
        self.n_heads = num_heads
        self.n_kv_heads = num_kv_heads
        self.head_dim = hidden_size // num_heads
        self.scale = self.head_dim**-0.5
        self.q_proj = nn.Linear(hidden_size, num_heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=True)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=True)
        self.o_proj = nn.Linear(num_heads * self.head_dim, hidden_size, bias=False)
        self.q_layernorm = LayerNormPerHead(self.head_dim, num_heads, eps)
        self.k_layernorm = LayerNormPerHead(self.head_dim, num_kv_heads, eps)
        self.rope = RoPE(
            int(partial_rotary_factor * self.head_dim), traditional=False, base=10000.0
        )

    def forward(self, x, mask=None):
        B, L, _ = x.shape
        queries, keys, values = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        queries = self.q_layernorm(queries.reshape(B, L, self.n_heads, -1)).transpose(1, 2)
        keys = self.k_layernorm(keys.reshape(B, L, self.n_kv_heads, -1)).transpose(1, 2)
        values = values.reshape(B, L, self.n_kv_heads, -1).transpose(1, 2)
        queries = self.rope(queries)
        keys = self.rope(keys)
        output = scaled_dot_product_attention(queries, keys, values, scale=self.scale, mask=mask)
        output = output.transpose(1, 2).reshape(B, L, -1)
        return self.o_proj(output)


class DecoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(64, eps=1e-5)
        self.self_attn = Attention()

    def forward(self, x):
        return x + self.self_attn(self.input_layernorm(x), mask="causal")


def make_mlx_stablelm_layer():
    torch.manual_seed(1013)
    layer = DecoderLayer()
    with torch.no_grad():
        layer.input_layernorm.weight.uniform_(0.5, 1.5)
        layer.input_layernorm.bias.uniform_(-0.2, 0.2)
        for ln in list(layer.self_attn.q_layernorm.norms) + list(layer.self_attn.k_layernorm.norms):
            ln.weight.uniform_(0.5, 1.5)
    return layer.eval()


EXPECT = {
    "target": "make_mlx_stablelm_layer",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "self_attn",
    "structure": {
        "heads": 4,
        "kv_heads": 2,
        "head_dim": 16,
        "causal": True,
        "cross": False,
        "rope": {"pairing": "half", "fraction": 0.25, "base": 10000},
        "qk_norm": "per-head",
        "window": None,
        "bias": None,
    },
    "style": "torch port of mlx-lm StableLM-2 attention: forward(x, mask='causal') with a torch.where finfo.min fill, nn.RoPE(4, traditional=False) "
    "on 4 of 16 dims, GQA 4:2 repeat_interleave in the sdpa helper, bias-free LayerNormPerHead (own gains per head) before the rotary",
}

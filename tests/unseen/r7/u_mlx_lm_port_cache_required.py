"""An mlx-lm llama Attention ported to torch: forward(x, mask, cache) with the KVCache object required (rotary offset
from cache.offset, keys/values from cache.update_and_fetch). Correct, but it cannot run without its cache object."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


class KVCache:
    """Grows in steps like mlx-lm's KVCache; keys/values are (B, n_kv_heads, T, head_dim)."""

    step = 16

    def __init__(self):
        self.keys = None
        self.values = None
        self.offset = 0

    def update_and_fetch(self, keys, values):
        prev = self.offset
        if self.keys is None or (prev + keys.shape[2]) > self.keys.shape[2]:
            B, n_kv_heads, _, k_head_dim = keys.shape
            n_steps = (self.step + keys.shape[2] - 1) // self.step
            shape = (B, n_kv_heads, n_steps * self.step, k_head_dim)
            new_k = torch.zeros(shape, dtype=keys.dtype, device=keys.device)
            new_v = torch.zeros(shape, dtype=values.dtype, device=values.device)
            if self.keys is not None:
                self.keys = torch.cat([self.keys[..., :prev, :], new_k], dim=2)
                self.values = torch.cat([self.values[..., :prev, :], new_v], dim=2)
            else:
                self.keys, self.values = new_k, new_v
        self.offset += keys.shape[2]
        self.keys[..., prev : self.offset, :] = keys
        self.values[..., prev : self.offset, :] = values
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]


class RoPE(nn.Module):
    """mlx.nn.RoPE(dims, traditional=False, base): rotates the two halves of the feature axis."""

    def __init__(self, dims, traditional=False, base=10000.0):
        super().__init__()
        self.dims = dims
        self.traditional = traditional
        self.base = base

    def forward(self, x, offset=0):
        L = x.shape[-2]
        half = self.dims // 2
        inv_freq = self.base ** (
            -torch.arange(0, half, dtype=torch.float64, device=x.device) / half
        )
        pos = torch.arange(offset, offset + L, dtype=torch.float64, device=x.device)
        theta = pos[:, None] * inv_freq[None, :]
        cos, sin = theta.cos().to(x.dtype), theta.sin().to(x.dtype)
        if self.traditional:
            x1, x2 = x[..., 0 : self.dims : 2], x[..., 1 : self.dims : 2]
            rx = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
        else:
            x1, x2 = x[..., :half], x[..., half : self.dims]
            rx = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
        return torch.cat([rx, x[..., self.dims :]], dim=-1)


@dataclass
class ModelArgs:
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    rope_theta: float = 10000.0
    rope_traditional: bool = False
    attention_bias: bool = False


def create_causal_mask(N, offset=0):
    rinds = torch.arange(offset + N)
    linds = torch.arange(offset, offset + N) if offset else rinds
    return linds[:, None] >= rinds[None]


class Attention(nn.Module):
    def __init__(self, args=None):
        super().__init__()
        args = args or ModelArgs()
        dim = args.hidden_size
        self.n_heads = n_heads = args.num_attention_heads
        self.n_kv_heads = n_kv_heads = args.num_key_value_heads
        self.head_dim = head_dim = args.hidden_size // n_heads
        self.scale = head_dim**-0.5
        self.q_proj = nn.Linear(dim, n_heads * head_dim, bias=args.attention_bias)
        self.k_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=args.attention_bias)
        self.v_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=args.attention_bias)
        self.o_proj = nn.Linear(n_heads * head_dim, dim, bias=args.attention_bias)
        self.rope = RoPE(head_dim, traditional=args.rope_traditional, base=args.rope_theta)

    def forward(self, x, mask, cache):
        B, L, D = x.shape
        queries, keys, values = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        queries = queries.reshape(B, L, self.n_heads, -1).transpose(1, 2)
        keys = keys.reshape(B, L, self.n_kv_heads, -1).transpose(1, 2)
        values = values.reshape(B, L, self.n_kv_heads, -1).transpose(1, 2)

        queries = self.rope(queries, offset=cache.offset)
        keys = self.rope(keys, offset=cache.offset)
        keys, values = cache.update_and_fetch(keys, values)

        if isinstance(mask, str) and mask == "causal":
            mask = create_causal_mask(L, offset=keys.shape[2] - L).to(x.device)
        output = F.scaled_dot_product_attention(
            queries,
            keys,
            values,
            attn_mask=mask,
            scale=self.scale,
            enable_gqa=self.n_kv_heads != self.n_heads,
        )
        output = output.transpose(1, 2).reshape(B, L, -1)
        return self.o_proj(output)


EXPECT = {
    "target": "Attention",
    "kind": "causal-multihead",
    "ok": True,
    "unsupported": "kv_cache",
    "style": "mlx-lm llama Attention ported to torch (forward(x, mask, cache) with cache required, RoPE(traditional=False) at cache.offset, KVCache.update_and_fetch growing in steps of 16, 'causal' mask string, GQA 4:2)",
}

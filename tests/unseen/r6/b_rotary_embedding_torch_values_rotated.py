"""A lucidrains-style causal attention using the rotary-embedding-torch RotaryEmbedding (freqs as a frozen
Parameter, '... n -> ... (n r)' interleaved tables, rotate_queries_or_keys over the sequence dim) and
SDPA(is_causal=True); bug: the rotation is mapped over (q, k, v) in one line, so the values are rotated
too."""

import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from torch import einsum, nn


def exists(val):
    return val is not None


def default(val, d):
    return val if exists(val) else d


def rotate_half(x):
    x = rearrange(x, "... (d r) -> ... d r", r=2)
    x1, x2 = x.unbind(dim=-1)
    x = torch.stack((-x2, x1), dim=-1)
    return rearrange(x, "... d r -> ... (d r)")


def apply_rotary_emb(freqs, t, start_index=0, scale=1.0, seq_dim=-2):
    dtype = t.dtype
    if t.ndim == 3:
        seq_len = t.shape[seq_dim]
        freqs = freqs[-seq_len:]
    rot_dim = freqs.shape[-1]
    end_index = start_index + rot_dim
    assert rot_dim <= t.shape[-1], (
        f"feature dimension {t.shape[-1]} is not of sufficient size to rotate in all the positions {rot_dim}"
    )
    t_left, t, t_right = t[..., :start_index], t[..., start_index:end_index], t[..., end_index:]
    t = (t * freqs.cos() * scale) + (rotate_half(t) * freqs.sin() * scale)
    out = torch.cat((t_left, t, t_right), dim=-1)
    return out.type(dtype)


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        dim,
        theta=10000,
        interpolate_factor=1.0,
        learned_freq=False,
        seq_before_head_dim=False,
    ):
        super().__init__()
        freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
        self.freqs = nn.Parameter(freqs, requires_grad=learned_freq)
        self.interpolate_factor = interpolate_factor
        self.default_seq_dim = -3 if seq_before_head_dim else -2

    def get_seq_pos(self, seq_len, device, dtype, offset=0):
        return (
            torch.arange(seq_len, device=device, dtype=dtype) + offset
        ) / self.interpolate_factor

    def rotate_queries_or_keys(self, t, seq_dim=None, offset=0, scale=None):
        seq_dim = default(seq_dim, self.default_seq_dim)
        device, dtype, seq_len = t.device, t.dtype, t.shape[seq_dim]
        seq = self.get_seq_pos(seq_len, device=device, dtype=dtype, offset=offset)
        freqs = self.forward(seq, seq_len=seq_len, offset=offset)
        if seq_dim == -3:
            freqs = rearrange(freqs, "n d -> n 1 d")
        return apply_rotary_emb(freqs, t, scale=default(scale, 1.0), seq_dim=seq_dim)

    def forward(self, t, seq_len=None, offset=0):
        freqs = self.freqs
        freqs = einsum("..., f -> ... f", t.type(freqs.dtype), freqs)
        freqs = repeat(freqs, "... n -> ... (n r)", r=2)
        return freqs


class CausalAttention(nn.Module):
    def __init__(self, dim, heads=4, dim_head=16):
        super().__init__()
        inner_dim = heads * dim_head
        self.heads = heads
        self.scale = dim_head**-0.5
        self.to_qkv = nn.Linear(dim, inner_dim * 3, bias=False)
        self.rotary_emb = RotaryEmbedding(dim=dim_head)
        self.to_out = nn.Linear(inner_dim, dim, bias=False)

    def forward(self, x):
        q, k, v = self.to_qkv(x).chunk(3, dim=-1)
        q, k, v = map(lambda t: rearrange(t, "b n (h d) -> b h n d", h=self.heads), (q, k, v))

        # rotary embeddings
        q, k, v = map(self.rotary_emb.rotate_queries_or_keys, (q, k, v))

        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        out = rearrange(out, "b h n d -> b n (h d)")
        return self.to_out(out)


class Transformer(nn.Module):
    def __init__(self, dim=64, depth=1, heads=4, dim_head=16, ff_mult=4):
        super().__init__()
        self.layers = nn.ModuleList([])
        for _ in range(depth):
            self.layers.append(
                nn.ModuleList(
                    [
                        nn.LayerNorm(dim),
                        CausalAttention(dim, heads=heads, dim_head=dim_head),
                        nn.Sequential(
                            nn.LayerNorm(dim),
                            nn.Linear(dim, dim * ff_mult),
                            nn.GELU(),
                            nn.Linear(dim * ff_mult, dim),
                        ),
                    ]
                )
            )
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        for norm, attn, ff in self.layers:
            x = attn(norm(x)) + x
            x = ff(x) + x
        return self.norm(x)


def make_transformer():
    return Transformer()


EXPECT = {
    "target": "make_transformer",
    "kind": "causal-multihead",
    "ok": False,
    "stage": "values",
    "mistake": "rope_on_values",
    "layer": "layers.0.1",
    "style": "lucidrains-style attention with rotary-embedding-torch (interleaved '(n r)' freqs, rotate_queries_or_keys) and SDPA is_causal; rotation mapped over q, k and v",
}

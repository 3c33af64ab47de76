"""EvolutionaryScale ESM3 style MultiHeadAttention in a UnifiedTransformerBlock: layernorm_qkv is a
Sequential(LayerNorm, Linear(d, 3d, bias=False)) whose output is chunked into q | k | v; q_ln and k_ln
are bias-free LayerNorms over the whole d_model projection (QK norm before the heads are split);
rotary (rotate_half, non-interleaved) is applied on (b, s, h, d) after unflatten; heads via an
einops rearrange partial "b s (h d) -> b h s d"; F.scaled_dot_product_attention; the block adds
the attention output divided by a residue scaling factor. Bidirectional.

This file's one bug: ESM3 MultiHeadAttention: _apply_rotary moved before q_ln/k_ln, so the whole-
projection LayerNorms run on rotated queries and keys."""

import functools
import math

import einops
import torch
import torch.nn.functional as F
from torch import nn


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_emb_torch(x, cos, sin):
    ro_dim = cos.shape[-1] * 2
    assert ro_dim <= x.shape[-1]
    seqlen = x.size(1)
    cos = cos[:seqlen]
    sin = sin[:seqlen]
    cos = einops.repeat(cos, "s d -> s 1 (2 d)")
    sin = einops.repeat(sin, "s d -> s 1 (2 d)")
    return torch.cat(
        [x[..., :ro_dim] * cos + rotate_half(x[..., :ro_dim]) * sin, x[..., ro_dim:]], dim=-1
    )


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, base=10000.0):
        super().__init__()
        self.dim = dim
        self.base = base
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _update_cos_sin_cache(self, seqlen, device, dtype):
        t = torch.arange(seqlen, device=device, dtype=torch.float64)
        freqs = torch.outer(t, self.inv_freq)
        self._cos_cached = torch.cos(freqs).to(dtype)
        self._sin_cached = torch.sin(freqs).to(dtype)

    def forward(self, q, k):
        self._update_cos_sin_cache(q.shape[1], device=q.device, dtype=q.dtype)
        q_ro = apply_rotary_emb_torch(q, self._cos_cached, self._sin_cached)
        k_ro = apply_rotary_emb_torch(k, self._cos_cached, self._sin_cached)
        return q_ro, k_ro


class MultiHeadAttention(nn.Module):
    def __init__(self, d_model, n_heads, bias=False, qk_layernorm=True):
        super().__init__()
        self.d_model = d_model
        self.n_heads = n_heads
        self.d_head = self.d_model // self.n_heads
        self.layernorm_qkv = nn.Sequential(
            nn.LayerNorm(d_model), nn.Linear(d_model, d_model * 3, bias=bias)
        )
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)
        if qk_layernorm:
            self.q_ln = nn.LayerNorm(d_model, bias=bias)
            self.k_ln = nn.LayerNorm(d_model, bias=bias)
        else:
            self.q_ln = nn.Identity()
            self.k_ln = nn.Identity()
        self.rotary = RotaryEmbedding(d_model // n_heads)

    def _apply_rotary(self, q, k):
        q = q.unflatten(-1, (self.n_heads, self.d_head))
        k = k.unflatten(-1, (self.n_heads, self.d_head))
        q, k = self.rotary(q, k)
        q = q.flatten(-2, -1)
        k = k.flatten(-2, -1)
        return q, k

    def forward(self, x, seq_id=None):
        qkv_BLD3 = self.layernorm_qkv(x)
        query_BLD, key_BLD, value_BLD = torch.chunk(qkv_BLD3, 3, dim=-1)
        query_BLD, key_BLD = self._apply_rotary(query_BLD, key_BLD)
        query_BLD, key_BLD = (
            self.q_ln(query_BLD).to(query_BLD.dtype),
            self.k_ln(key_BLD).to(query_BLD.dtype),
        )

        reshaper = functools.partial(
            einops.rearrange, pattern="b s (h d) -> b h s d", h=self.n_heads
        )
        query_BHLD, key_BHLD, value_BHLD = map(reshaper, (query_BLD, key_BLD, value_BLD))

        context_BHLD = F.scaled_dot_product_attention(query_BHLD, key_BHLD, value_BHLD)
        context_BLD = einops.rearrange(context_BHLD, "b h s d -> b s (h d)")
        return self.out_proj(context_BLD)


class UnifiedTransformerBlock(nn.Module):
    def __init__(self, d_model=64, n_heads=4, n_layers_total=4, residue_scaling_factor=1.0):
        super().__init__()
        self.attn = MultiHeadAttention(d_model, n_heads, bias=False, qk_layernorm=True)
        self.scaling_factor = residue_scaling_factor
        self.ffn = nn.Sequential(
            nn.LayerNorm(d_model),
            nn.Linear(d_model, 2 * d_model, bias=False),
            nn.GELU(),
            nn.Linear(2 * d_model, d_model, bias=False),
        )

    def forward(self, x, sequence_id=None):
        r1 = self.attn(x, sequence_id)
        x = x + r1 / self.scaling_factor
        r3 = self.ffn(x) / self.scaling_factor
        return x + r3


def make_esm3_block():
    torch.manual_seed(1202)
    block = UnifiedTransformerBlock(residue_scaling_factor=math.sqrt(48 / 36))
    with torch.no_grad():
        for mod in block.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                if mod.bias is not None:
                    mod.bias.uniform_(-0.2, 0.2)
    return block.eval()


EXPECT = {
    "target": "make_esm3_block",
    "kind": "multihead",
    "ok": False,
    "layer": "attn",
    "stage": "normed_queries",
    "mistake": "qk_norm_misplaced",
    "style": "ESM3 MultiHeadAttention: _apply_rotary moved before q_ln/k_ln, so the whole-projection "
    "LayerNorms run on rotated queries and keys",
}

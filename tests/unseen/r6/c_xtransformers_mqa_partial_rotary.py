"""lucidrains x-transformers style decoder attention: to_q/to_k/to_v/to_out, a single key/value head
(kv_heads=1, squeezed to 'b n d' and contracted with einsum 'b h i d, b j d -> b h i j'), rotary on the
first half of each head (rotary_emb_dim = dim_head // 2) with interleaved pairs (rotate_half over
'(d r)'), the rotary frequencies computed once by the layer stack and passed down, bool triu causal mask
filled with -finfo.max; layers stored as ModuleList([norm, block, residual])."""

import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from torch import einsum, nn


def exists(val):
    return val is not None


def default(val, d):
    return val if exists(val) else d


def max_neg_value(tensor):
    return -torch.finfo(tensor.dtype).max


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, base=10000, interpolation_factor=1.0):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq)
        self.interpolation_factor = interpolation_factor

    def forward_from_seq_len(self, seq_len):
        device = self.inv_freq.device
        t = torch.arange(seq_len, device=device)
        return self.forward(t)

    def forward(self, t):
        if t.ndim == 1:
            t = rearrange(t, "n -> 1 n")
        freqs = (
            torch.einsum("b i , j -> b i j", t.type_as(self.inv_freq), self.inv_freq)
            / self.interpolation_factor
        )
        freqs = torch.stack((freqs, freqs), dim=-1)
        freqs = rearrange(freqs, "... d r -> ... (d r)")
        return freqs, 1.0


def rotate_half(x):
    x = rearrange(x, "... (d r) -> ... d r", r=2)
    x1, x2 = x.unbind(dim=-1)
    x = torch.stack((-x2, x1), dim=-1)
    return rearrange(x, "... d r -> ... (d r)")


def apply_rotary_pos_emb(t, freqs, scale=1):
    rot_dim, seq_len, orig_dtype = freqs.shape[-1], t.shape[-2], t.dtype
    freqs = freqs[:, -seq_len:, :]
    if t.ndim == 4 and freqs.ndim == 3:
        freqs = rearrange(freqs, "b n d -> b 1 n d")
    # partial rotary embeddings, Wang et al. GPT-J
    t, t_unrotated = t[..., :rot_dim], t[..., rot_dim:]
    t = (t * freqs.cos() * scale) + (rotate_half(t) * freqs.sin() * scale)
    out = torch.cat((t, t_unrotated), dim=-1)
    return out.type(orig_dtype)


class Attend(nn.Module):
    def __init__(self, *, causal=False, scale=None):
        super().__init__()
        self.scale = scale
        self.causal = causal

    def forward(self, q, k, v, mask=None):
        n, heads, kv_heads = q.shape[-2], q.shape[1], k.shape[1]
        scale = default(self.scale, q.shape[-1] ** -0.5)

        # handle grouped multi-query attention
        if kv_heads == 1:
            k, v = tuple(rearrange(t, "b 1 n d -> b n d") for t in (k, v))
        elif kv_heads < heads:
            raise NotImplementedError("this port only keeps the multi-query path")

        kv_einsum_eq = "b j d" if k.ndim == 3 else "b h j d"
        dots = einsum(f"b h i d, {kv_einsum_eq} -> b h i j", q, k) * scale

        i, j, dtype = *dots.shape[-2:], dots.dtype
        mask_value = max_neg_value(dots)
        if exists(mask):
            dots = dots.masked_fill(~mask, mask_value)
        if self.causal:
            causal_mask = torch.ones((i, j), dtype=torch.bool, device=dots.device).triu(j - i + 1)
            dots = dots.masked_fill(causal_mask, mask_value)

        attn = dots.softmax(dim=-1)
        out = einsum(f"b h i j, {kv_einsum_eq} -> b h i d", attn, v)
        return out, attn


class Attention(nn.Module):
    def __init__(self, dim, dim_head=16, heads=4, kv_heads=None, causal=False):
        super().__init__()
        self.scale = dim_head**-0.5
        self.heads = heads
        self.causal = causal
        kv_heads = default(kv_heads, heads)
        self.kv_heads = kv_heads
        q_dim = dim_head * heads
        k_dim = dim_head * kv_heads
        v_dim = dim_head * kv_heads
        self.to_q = nn.Linear(dim, q_dim, bias=False)
        self.to_k = nn.Linear(dim, k_dim, bias=False)
        self.to_v = nn.Linear(dim, v_dim, bias=False)
        self.attend = Attend(causal=causal, scale=self.scale)
        self.to_out = nn.Linear(q_dim, dim, bias=False)

    def forward(self, x, context=None, mask=None, rotary_pos_emb=None):
        h, kv_h = self.heads, self.kv_heads
        kv_input = default(context, x)

        q = self.to_q(x)
        k = self.to_k(kv_input)
        v = self.to_v(kv_input)

        q = rearrange(q, "b n (h d) -> b h n d", h=h)
        k, v = tuple(rearrange(t, "b n (h d) -> b h n d", h=kv_h) for t in (k, v))

        if exists(rotary_pos_emb):
            freqs, xpos_scale = rotary_pos_emb
            q = apply_rotary_pos_emb(q, freqs, xpos_scale)
            k = apply_rotary_pos_emb(k, freqs, xpos_scale)

        out, _ = self.attend(q, k, v, mask=mask)
        out = rearrange(out, "b h n d -> b n (h d)")
        return self.to_out(out)


class FeedForward(nn.Module):
    def __init__(self, dim, mult=4):
        super().__init__()
        self.ff = nn.Sequential(nn.Linear(dim, dim * mult), nn.GELU(), nn.Linear(dim * mult, dim))

    def forward(self, x):
        return self.ff(x)


class Residual(nn.Module):
    def forward(self, x, residual):
        return x + residual


class Decoder(nn.Module):
    def __init__(
        self,
        dim,
        depth=1,
        heads=4,
        attn_dim_head=16,
        attn_kv_heads=1,
        rotary_emb_dim=None,
        rotary_base=10000,
    ):
        super().__init__()
        rotary_emb_dim = default(rotary_emb_dim, attn_dim_head // 2)
        self.rotary_pos_emb = RotaryEmbedding(rotary_emb_dim, base=rotary_base)
        self.layers = nn.ModuleList([])
        for _ in range(depth):
            self.layers.append(
                nn.ModuleList(
                    [
                        nn.LayerNorm(dim),
                        Attention(
                            dim,
                            dim_head=attn_dim_head,
                            heads=heads,
                            kv_heads=attn_kv_heads,
                            causal=True,
                        ),
                        Residual(),
                    ]
                )
            )
            self.layers.append(nn.ModuleList([nn.LayerNorm(dim), FeedForward(dim), Residual()]))
        self.final_norm = nn.LayerNorm(dim)

    def forward(self, x):
        rotary_pos_emb = self.rotary_pos_emb.forward_from_seq_len(x.shape[1])
        for norm, block, residual_fn in self.layers:
            residual = x
            x = norm(x)
            if isinstance(block, Attention):
                out = block(x, rotary_pos_emb=rotary_pos_emb)
            else:
                out = block(x)
            x = residual_fn(out, residual)
        return self.final_norm(x)


def make_decoder():
    return Decoder(dim=64, depth=1, heads=4, attn_dim_head=16, attn_kv_heads=1)


EXPECT = {
    "target": "make_decoder",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "layers.0.1",
    "structure": {
        "heads": 4,
        "kv_heads": 1,
        "head_dim": 16,
        "causal": True,
        "cross": False,
        "rope": {"pairing": "interleaved", "fraction": 0.5, "base": 10000.0},
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "lucidrains x-transformers Attention/Attend (to_q/to_k/to_v, kv_heads=1 squeezed to 'b j d' einsum, partial interleaved rotary dim_head//2, -finfo.max triu mask, layers as [norm, block, residual])",
}

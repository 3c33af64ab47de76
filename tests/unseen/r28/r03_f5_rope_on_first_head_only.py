"""SWivid F5-TTS DiT block attention (src/f5_tts/model/modules.py: `Attention` + `AttnProcessor`, torch
backend): to_q/to_k/to_v with bias, `view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)`,
optional per-head `q_norm`/`k_norm` RMSNorm (`qk_norm="rms_norm"`), rotary embedding from
x-transformers' `RotaryEmbedding(dim_head)` (`forward_from_seq_len`, interleaved (d r) pairs,
`apply_rotary_pos_emb(t, freqs, scale)` rotating the first `freqs.shape[-1]` features), non-causal
`F.scaled_dot_product_attention`, `to_out` (Linear, Dropout). Block: AdaLayerNorm modulation from a
time embedding (a learned timestep here), gated residuals, tanh-GELU feed-forward.

This file: refused: F5-TTS's pe_attn_head=1: the rotary embedding is applied to the first attention head only; the other heads attend without positions."""

import math

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        return x * self.weight


# x-transformers style rotary embedding (interleaved pairs)


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, base=10000.0, interpolation_factor=1.0):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.interpolation_factor = interpolation_factor

    def forward_from_seq_len(self, seq_len):
        t = torch.arange(seq_len, dtype=torch.float64)
        return self.forward(t)

    def forward(self, t):
        freqs = torch.einsum("i , j -> i j", t.to(self.inv_freq.dtype), self.inv_freq)
        freqs = freqs / self.interpolation_factor
        freqs = torch.stack((freqs, freqs), dim=-1)
        freqs = freqs.reshape(*freqs.shape[:-2], -1)  # '... d r -> ... (d r)'
        return freqs, None


def rotate_half(x):
    x = x.reshape(*x.shape[:-1], -1, 2)  # '... (d r) -> ... d r', r = 2
    x1, x2 = x.unbind(dim=-1)
    x = torch.stack((-x2, x1), dim=-1)
    return x.reshape(*x.shape[:-2], -1)  # '... d r -> ... (d r)'


def apply_rotary_pos_emb(t, freqs, scale=1):
    rot_dim, seq_len = freqs.shape[-1], t.shape[-2]
    freqs = freqs[-seq_len:, :].to(t.dtype)
    t, t_unrotated = t[..., :rot_dim], t[..., rot_dim:]
    t = (t * freqs.cos() * scale) + (rotate_half(t) * freqs.sin() * scale)
    return torch.cat((t, t_unrotated), dim=-1)


class Attention(nn.Module):
    def __init__(self, processor, dim, heads=8, dim_head=64, dropout=0.0, qk_norm=None):
        super().__init__()
        self.processor = processor
        self.dim = dim
        self.heads = heads
        self.inner_dim = dim_head * heads
        self.dropout = dropout
        self.to_q = nn.Linear(dim, self.inner_dim)
        self.to_k = nn.Linear(dim, self.inner_dim)
        self.to_v = nn.Linear(dim, self.inner_dim)
        if qk_norm is None:
            self.q_norm = None
            self.k_norm = None
        elif qk_norm == "rms_norm":
            self.q_norm = RMSNorm(dim_head, eps=1e-6)
            self.k_norm = RMSNorm(dim_head, eps=1e-6)
        else:
            raise ValueError(f"Unimplemented qk_norm: {qk_norm}")
        self.to_out = nn.ModuleList([nn.Linear(self.inner_dim, dim), nn.Dropout(dropout)])

    def forward(self, x, mask=None, rope=None):
        return self.processor(self, x, mask=mask, rope=rope)


class AttnProcessor:
    def __init__(self, pe_attn_head=None, attn_backend="torch"):
        self.pe_attn_head = pe_attn_head
        self.attn_backend = attn_backend

    def __call__(self, attn, x, mask=None, rope=None):
        batch_size = x.shape[0]

        query = attn.to_q(x)
        key = attn.to_k(x)
        value = attn.to_v(x)

        inner_dim = key.shape[-1]
        head_dim = inner_dim // attn.heads
        query = query.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        key = key.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        value = value.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)

        # qk norm
        if attn.q_norm is not None:
            query = attn.q_norm(query)
        if attn.k_norm is not None:
            key = attn.k_norm(key)

        # apply rotary position embedding
        if rope is not None:
            freqs, xpos_scale = rope
            q_xpos_scale, k_xpos_scale = (xpos_scale, xpos_scale**-1.0) if xpos_scale is not None else (1.0, 1.0)
            if self.pe_attn_head is not None:
                pn = self.pe_attn_head
                query[:, :pn, :, :] = apply_rotary_pos_emb(query[:, :pn, :, :], freqs, q_xpos_scale)
                key[:, :pn, :, :] = apply_rotary_pos_emb(key[:, :pn, :, :], freqs, k_xpos_scale)
            else:
                query = apply_rotary_pos_emb(query, freqs, q_xpos_scale)
                key = apply_rotary_pos_emb(key, freqs, k_xpos_scale)

        x = F.scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False)
        x = x.transpose(1, 2).reshape(batch_size, -1, attn.heads * head_dim)
        x = x.to(query.dtype)

        x = attn.to_out[0](x)
        x = attn.to_out[1](x)
        if mask is not None:
            x = x.masked_fill(~mask.unsqueeze(-1), 0.0)
        return x


class AdaLayerNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.silu = nn.SiLU()
        self.linear = nn.Linear(dim, dim * 6)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)

    def forward(self, x, emb=None):
        emb = self.linear(self.silu(emb))
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = torch.chunk(emb, 6, dim=1)
        x = self.norm(x) * (1 + scale_msa[:, None]) + shift_msa[:, None]
        return x, gate_msa, shift_mlp, scale_mlp, gate_mlp


class FeedForward(nn.Module):
    def __init__(self, dim, mult=2):
        super().__init__()
        inner = int(dim * mult)
        self.ff = nn.Sequential(nn.Linear(dim, inner), nn.GELU(approximate="tanh"), nn.Linear(inner, dim))

    def forward(self, x):
        return self.ff(x)


class DiTBlock(nn.Module):
    def __init__(self, dim, heads, dim_head, ff_mult=2, qk_norm=None, pe_attn_head=None):
        super().__init__()
        self.attn_norm = AdaLayerNorm(dim)
        self.attn = Attention(
            processor=AttnProcessor(pe_attn_head=pe_attn_head, attn_backend="torch"),
            dim=dim,
            heads=heads,
            dim_head=dim_head,
            qk_norm=qk_norm,
        )
        self.ff_norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.ff = FeedForward(dim=dim, mult=ff_mult)

    def forward(self, x, t, mask=None, rope=None):
        norm, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.attn_norm(x, emb=t)
        attn_output = self.attn(x=norm, mask=mask, rope=rope)
        x = x + gate_msa.unsqueeze(1) * attn_output
        norm = self.ff_norm(x) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
        x = x + gate_mlp.unsqueeze(1) * self.ff(norm)
        return x


class DiT(nn.Module):
    """The F5 DiT backbone cut to its transformer blocks, conditioned on one learned timestep vector."""

    def __init__(self, dim=64, depth=1, heads=4, dim_head=16, qk_norm="rms_norm", pe_attn_head=1):
        super().__init__()
        self.time_embed = nn.Parameter(torch.randn(dim) * 0.5)
        self.rotary_embed = RotaryEmbedding(dim_head)
        self.transformer_blocks = nn.ModuleList(
            [DiTBlock(dim, heads, dim_head, qk_norm=qk_norm, pe_attn_head=pe_attn_head) for _ in range(depth)]
        )
        self.norm_out = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)

    def forward(self, x):
        batch, seq_len = x.shape[0], x.shape[1]
        t = self.time_embed.to(x.dtype)[None].expand(batch, -1)
        rope = self.rotary_embed.forward_from_seq_len(seq_len)
        for block in self.transformer_blocks:
            x = block(x, t, mask=None, rope=rope)
        return self.norm_out(x)


def make_f5_dit():
    torch.manual_seed(2801)
    model = DiT()
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, RMSNorm):
                mod.weight.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {
    "target": "make_f5_dit",
    "kind": "multihead",
    "ok": True,
    "layer": "transformer_blocks.0.attn",
    "unsupported": "rope_subset_heads",
    "style": "F5-TTS Attention/AttnProcessor: pe_attn_head=1: RoPE on head 0 only"
}

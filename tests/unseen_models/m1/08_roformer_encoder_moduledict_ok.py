"""A small RoFormer-style bidirectional encoder with an MLM head.

Rotary position embedding in RoFormer's original layout: sinusoidal sin/cos tables
repeat_interleave'd by 2 and applied with rotate_every_two (adjacent pairs).  Fused Wqkv
projection, pre-norm LayerNorm blocks kept in an nn.ModuleDict keyed "layer_0".."layer_2",
optional attention_mask (1 = keep, 0 = pad) passed down as a boolean key mask.  forward
returns MLM logits (batch, tokens, vocab).  No cache.  Correct.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": [
        "encoder.layers.layer_0.attn",
        "encoder.layers.layer_1.attn",
        "encoder.layers.layer_2.attn",
    ],
    "kind": "multihead",
    "cache": None,
    "structure": {
        "heads": 6,
        "kv_heads": 6,
        "head_dim": 16,
        "causal": False,
        "cross": False,
        "rope": {"pairing": "interleaved", "fraction": 1.0, "base": 10000.0},
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "RoFormer (modeling_roformer.py) sinusoidal rotary with rotate_every_two; fused Wqkv; "
    "ModuleDict of blocks; pre-norm; boolean padding mask into SDPA",
}


class SinusoidalRotary(nn.Module):
    def __init__(self, head_dim, max_positions=128, base=10000.0):
        super().__init__()
        inv = 1.0 / (base ** (torch.arange(0, head_dim, 2).float() / head_dim))
        pos = torch.arange(max_positions).float()
        sinusoid = torch.einsum("i,j->ij", pos, inv)  # (max_positions, head_dim/2)
        self.register_buffer("sin", sinusoid.sin(), persistent=False)
        self.register_buffer("cos", sinusoid.cos(), persistent=False)

    def forward(self, seq_len):
        return self.sin[:seq_len], self.cos[:seq_len]


def rotate_every_two(x):
    x1 = x[..., 0::2]
    x2 = x[..., 1::2]
    return torch.stack([-x2, x1], dim=-1).reshape_as(x)


def apply_rotary(x, sin, cos):
    # x: (B, H, T, D); sin/cos: (T, D/2) -> (T, D) with each angle used for one adjacent pair
    sin_pos = sin.repeat_interleave(2, dim=-1)[None, None]
    cos_pos = cos.repeat_interleave(2, dim=-1)[None, None]
    return x * cos_pos + rotate_every_two(x) * sin_pos


class RotarySelfAttention(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.Wqkv = nn.Linear(d_model, 3 * d_model)
        self.Wo = nn.Linear(d_model, d_model)

    def forward(self, hidden_states, sin, cos, key_padding_mask=None):
        B, T, C = hidden_states.shape
        qkv = self.Wqkv(hidden_states).view(B, T, 3, self.n_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (B, H, T, D)
        q = apply_rotary(q, sin, cos)
        k = apply_rotary(k, sin, cos)
        attn_mask = None
        if key_padding_mask is not None:
            attn_mask = key_padding_mask[:, None, None, :].bool()  # True = may attend
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        out = out.transpose(1, 2).reshape(B, T, C)
        return self.Wo(out)


class EncoderBlock(nn.Module):
    def __init__(self, d_model, n_heads, d_ff):
        super().__init__()
        self.attn_norm = nn.LayerNorm(d_model)
        self.attn = RotarySelfAttention(d_model, n_heads)
        self.mlp_norm = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, d_ff), nn.GELU(), nn.Linear(d_ff, d_model))

    def forward(self, x, sin, cos, key_padding_mask=None):
        x = x + self.attn(self.attn_norm(x), sin, cos, key_padding_mask)
        return x + self.mlp(self.mlp_norm(x))


class Encoder(nn.Module):
    def __init__(self, d_model, n_heads, d_ff, n_layers, max_positions):
        super().__init__()
        self.rotary = SinusoidalRotary(d_model // n_heads, max_positions)
        self.layers = nn.ModuleDict(
            {f"layer_{i}": EncoderBlock(d_model, n_heads, d_ff) for i in range(n_layers)}
        )
        self.final_norm = nn.LayerNorm(d_model)

    def forward(self, x, key_padding_mask=None):
        sin, cos = self.rotary(x.shape[1])
        for name in sorted(self.layers.keys()):
            x = self.layers[name](x, sin, cos, key_padding_mask)
        return self.final_norm(x)


class RoFormerForMaskedLM(nn.Module):
    def __init__(
        self, vocab_size=200, d_model=96, n_heads=6, d_ff=192, n_layers=3, max_positions=128
    ):
        super().__init__()
        self.embeddings = nn.Embedding(vocab_size, d_model)
        self.emb_norm = nn.LayerNorm(d_model)
        self.encoder = Encoder(d_model, n_heads, d_ff, n_layers, max_positions)
        self.mlm_head = nn.Linear(d_model, vocab_size)

    def forward(self, input_ids, attention_mask=None):
        x = self.emb_norm(self.embeddings(input_ids))
        x = self.encoder(x, key_padding_mask=attention_mask)
        return self.mlm_head(x)


def make_model():
    torch.manual_seed(6174)
    model = RoFormerForMaskedLM()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn_like(m.weight))
                m.bias.copy_(0.1 * torch.randn_like(m.bias))
    return model.eval()

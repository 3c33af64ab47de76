"""Pyramid-Flow (jy0205): Pyramid-Flow MM-DiT attention (JointAttention) reduced to the video stream of a one-row strip: biased to_q/to_k/to_v, per-head RMSNorm norm_q/norm_k over the head dimension (Flux's QK norm), Flux-style rotary as 2x2 rotation matrices on adjacent channel pairs (apply_rope), biased to_out[0]; the model builds the rotary tables (float64, then cast) and the mask.

This file: correct: 4x16 heads, per-head RMSNorm QK norm, Flux rotation-matrix rotary (interleaved, base 1e4), model-built temporal-causal additive mask (one token per frame), SDPA."""
import torch
import torch.nn.functional as F
from torch import nn


class PyramidFlowConfig:
    hidden_size = 64
    num_attention_heads = 4
    attention_head_dim = 16
    rope_theta = 10000.0
    temporal_rope_dims = 16  # head channels carrying the temporal axis; the rest are spatial
    frame_tokens = 1
    qk_norm_eps = 1e-6


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        variance = hidden_states.float().pow(2).mean(-1, keepdim=True) if input_dtype != torch.float64 else hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance.to(input_dtype) + self.eps)
        return hidden_states * self.weight.to(input_dtype)


def strip_rotary_matrices(num_tokens, head_dim, rope_dims, theta, dtype, device, frame_tokens=1):
    """Flux-style 2x2 rotation matrices, one per channel pair. On a one-row strip the spatial
    axes sit at position 0, so only the first rope_dims channels of a head actually turn."""
    frame = torch.arange(num_tokens, device=device) // frame_tokens
    pos = frame.to(torch.float64)
    scale = torch.arange(0, rope_dims, 2, dtype=torch.float64, device=device) / rope_dims
    omega = 1.0 / (theta**scale)
    angles = pos[:, None] * omega[None, :]
    if rope_dims < head_dim:
        spatial = torch.zeros(num_tokens, (head_dim - rope_dims) // 2, dtype=torch.float64, device=device)
        angles = torch.cat([angles, spatial], dim=-1)
    cos, sin = angles.cos(), angles.sin()
    mats = torch.stack([cos, -sin, sin, cos], dim=-1).view(num_tokens, head_dim // 2, 2, 2)
    return mats.to(dtype)


def apply_rope(xq, xk, freqs_cis):
    # xq, xk: [batch, seq, heads, head_dim]; freqs_cis: [seq, head_dim // 2, 2, 2]
    freqs_cis = freqs_cis[None, :, None]
    xq_ = xq.reshape(*xq.shape[:-1], -1, 1, 2)
    xk_ = xk.reshape(*xk.shape[:-1], -1, 1, 2)
    xq_out = freqs_cis[..., 0] * xq_[..., 0] + freqs_cis[..., 1] * xq_[..., 1]
    xk_out = freqs_cis[..., 0] * xk_[..., 0] + freqs_cis[..., 1] * xk_[..., 1]
    return xq_out.reshape(*xq.shape).type_as(xq), xk_out.reshape(*xk.shape).type_as(xk)


class PyramidJointAttention(nn.Module):
    """Per-head RMSNorm QK norm (normalising the head dimension, as in Flux), biased projections."""

    def __init__(self, config):
        super().__init__()
        self.heads = config.num_attention_heads
        self.head_dim = config.attention_head_dim
        inner_dim = self.heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.to_q = nn.Linear(config.hidden_size, inner_dim, bias=True)
        self.to_k = nn.Linear(config.hidden_size, inner_dim, bias=True)
        self.to_v = nn.Linear(config.hidden_size, inner_dim, bias=True)
        self.norm_q = RMSNorm(self.head_dim, eps=config.qk_norm_eps)
        self.norm_k = RMSNorm(self.head_dim, eps=config.qk_norm_eps)
        self.to_out = nn.ModuleList([nn.Linear(inner_dim, config.hidden_size, bias=True), nn.Dropout(0.0)])

    def forward(self, hidden_states, image_rotary_emb, attention_mask=None):
        batch_size = hidden_states.shape[0]
        query = self.to_q(hidden_states).view(batch_size, -1, self.heads, self.head_dim)
        key = self.to_k(hidden_states).view(batch_size, -1, self.heads, self.head_dim)
        value = self.to_v(hidden_states).view(batch_size, -1, self.heads, self.head_dim)

        query = self.norm_q(query)
        key = self.norm_k(key)

        query, key = apply_rope(query, key, image_rotary_emb)

        query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        hidden_states = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False
        )
        hidden_states = hidden_states.transpose(1, 2).flatten(2, 3)
        hidden_states = self.to_out[0](hidden_states)
        return self.to_out[1](hidden_states)


class PyramidBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.attn = PyramidJointAttention(config)

    def forward(self, hidden_states, image_rotary_emb, attention_mask):
        return hidden_states + self.attn(self.norm1(hidden_states), image_rotary_emb, attention_mask)


class PyramidVideoStrip(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList([PyramidBlock(config)])

    def forward(self, hidden_states):
        batch_size, seq_len, _ = hidden_states.shape
        dtype, device = hidden_states.dtype, hidden_states.device
        cfg = self.config
        image_rotary_emb = strip_rotary_matrices(
            seq_len, cfg.attention_head_dim, cfg.temporal_rope_dims, cfg.rope_theta, dtype, device, cfg.frame_tokens
        )
        frame_id = torch.arange(seq_len, device=device) // self.config.frame_tokens
        allowed = frame_id[None, :] <= frame_id[:, None]  # temporal autoregressive: current and past frames
        attention_mask = torch.zeros(seq_len, seq_len, dtype=dtype, device=device)
        attention_mask = attention_mask.masked_fill(~allowed, torch.finfo(dtype).min)[None, None]
        for block in self.blocks:
            hidden_states = block(hidden_states, image_rotary_emb, attention_mask)
        return hidden_states


def make_pyramid_strip():
    torch.manual_seed(4700)
    model = PyramidVideoStrip(PyramidFlowConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, RMSNorm):
                mod.weight.uniform_(0.5, 1.5)
            elif isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
            elif isinstance(mod, nn.Linear) and mod.bias is not None:
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()

EXPECT = {
    "target": "make_pyramid_strip",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "blocks.0.attn",
    "structure": {
        "heads": 4,
        "kv_heads": 4,
        "head_dim": 16,
        "causal": True,
        "cross": False,
        "rope": {
            "pairing": "interleaved",
            "fraction": 1.0,
            "base": 10000
        },
        "qk_norm": "per-head",
        "window": None,
        "bias": None
    },
    "style": "Pyramid-Flow (jy0205) (c01): correct: 4x16 heads, per-head RMSNorm QK norm, Flux rotation-matrix rotary (interleaved, base 1e4), model-built temporal-causal additive mask (one token per frame), SDPA"
}

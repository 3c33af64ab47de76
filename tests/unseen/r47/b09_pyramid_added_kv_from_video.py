"""Pyramid-Flow (jy0205): Pyramid-Flow MM-DiT attention (JointAttention) reduced to the video stream of a one-row strip: biased to_q/to_k/to_v, per-head RMSNorm norm_q/norm_k over the head dimension (Flux's QK norm), Flux-style rotary as 2x2 rotation matrices on adjacent channel pairs (apply_rope), biased to_out[0]; the model builds the rotary tables (float64, then cast) and the mask.

This file: one bug: add_k_proj/add_v_proj are fed hidden_states (the video stream) instead of encoder_hidden_states: the caption is never read."""
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


class PyramidJointAttention(nn.Module):
    """Per-head RMSNorm QK norm (normalising the head dimension, as in Flux), biased projections."""

    def __init__(self, config):
        super().__init__()
        self.heads = config.num_attention_heads
        self.head_dim = config.attention_head_dim
        inner_dim = self.heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.to_q = nn.Linear(config.hidden_size, inner_dim, bias=True)
        self.add_k_proj = nn.Linear(config.hidden_size, inner_dim, bias=True)
        self.add_v_proj = nn.Linear(config.hidden_size, inner_dim, bias=True)
        self.norm_q = RMSNorm(self.head_dim, eps=config.qk_norm_eps)
        self.norm_added_k = RMSNorm(self.head_dim, eps=config.qk_norm_eps)
        self.to_out = nn.ModuleList([nn.Linear(inner_dim, config.hidden_size, bias=True), nn.Dropout(0.0)])

    def forward(self, hidden_states, encoder_hidden_states):
        batch_size, seq_len, _ = hidden_states.shape
        query = self.to_q(hidden_states).view(batch_size, -1, self.heads, self.head_dim)
        key = self.add_k_proj(hidden_states).view(batch_size, -1, self.heads, self.head_dim)
        value = self.add_v_proj(hidden_states).view(batch_size, -1, self.heads, self.head_dim)

        query = self.norm_q(query)
        key = self.norm_added_k(key)

        query, key, value = (t.transpose(1, 2) for t in (query, key, value))
        attn = torch.matmul(query, key.transpose(-1, -2)) * self.scale
        attn = attn.softmax(dim=-1)
        hidden_states = torch.matmul(attn, value)
        hidden_states = hidden_states.transpose(1, 2).flatten(2, 3)
        hidden_states = self.to_out[0](hidden_states)
        return self.to_out[1](hidden_states)


class PyramidCrossBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.attn = PyramidJointAttention(config)

    def forward(self, hidden_states, encoder_hidden_states):
        return hidden_states + self.attn(self.norm1(hidden_states), encoder_hidden_states)


class PyramidCaptionStrip(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList([PyramidCrossBlock(config)])

    def forward(self, hidden_states, encoder_hidden_states):
        for block in self.blocks:
            hidden_states = block(hidden_states, encoder_hidden_states)
        return hidden_states


def make_pyramid_strip():
    torch.manual_seed(4714)
    model = PyramidCaptionStrip(PyramidFlowConfig())
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
    "kind": "cross",
    "ok": False,
    "layer": "blocks.0.attn",
    "stage": "keys",
    "mistake": "wrong_source",
    "style": "Pyramid-Flow (jy0205) (b09_added_kv_from_video): (base c03) one bug: add_k_proj/add_v_proj are fed hidden_states (the video stream) instead of encoder_hidden_states: the caption is never read"
}

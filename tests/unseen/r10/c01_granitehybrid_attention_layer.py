"""IBM Granite-4 (GraniteMoeHybrid) attention decoder layer, written from scratch.

The model body owns the rotary table and the additive 4D mask; the attention module scales
by ``config.attention_multiplier`` (set here to head_dim ** -0.5), GQA 4:2 via repeat_kv,
eager matmul/softmax path, a residual_multiplier on the way out of the block.
"""

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class GraniteMoeHybridConfig:
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    attention_multiplier: float = 0.25
    residual_multiplier: float = 0.22
    attention_bias: bool = False


class GraniteMoeHybridRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class GraniteMoeHybridRotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        dim = config.hidden_size // config.num_attention_heads
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x, position_ids):
        freqs = position_ids[:, :, None].to(torch.float64) * self.inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def repeat_kv(hidden_states, n_rep):
    b, kvh, slen, d = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(b, kvh, n_rep, slen, d)
    return hidden_states.reshape(b, kvh * n_rep, slen, d)


class GraniteMoeHybridAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.scaling = config.attention_multiplier
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(
            h, self.num_key_value_heads * self.head_dim, bias=config.attention_bias
        )
        self.v_proj = nn.Linear(
            h, self.num_key_value_heads * self.head_dim, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(h, h, bias=config.attention_bias)

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None):
        bsz, q_len, _ = hidden_states.size()
        query_states = (
            self.q_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        )
        key_states = self.k_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        value_states = (
            self.v_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        )
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.scaling
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).contiguous()
        attn_output = attn_output.reshape(bsz, q_len, -1)
        return self.o_proj(attn_output), attn_weights


class GraniteMoeHybridDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = GraniteMoeHybridAttention(config, layer_idx)
        self.input_layernorm = GraniteMoeHybridRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.residual_multiplier = config.residual_multiplier

    def forward(self, hidden_states, attention_mask, position_embeddings):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(hidden_states, attention_mask, position_embeddings)
        return residual + hidden_states * self.residual_multiplier


class GraniteMoeHybridModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList([GraniteMoeHybridDecoderLayer(config, 0)])
        self.rotary_emb = GraniteMoeHybridRotaryEmbedding(config)
        self.norm = GraniteMoeHybridRMSNorm(config.hidden_size, config.rms_norm_eps)

    def _update_causal_mask(self, inputs_embeds):
        bsz, n, _ = inputs_embeds.shape
        dtype = inputs_embeds.dtype
        min_dtype = torch.finfo(dtype).min
        causal_mask = torch.full((n, n), fill_value=min_dtype, dtype=dtype)
        causal_mask = torch.triu(causal_mask, diagonal=1)
        return causal_mask[None, None, :, :].expand(bsz, 1, -1, -1)

    def forward(self, inputs_embeds):
        bsz, n, _ = inputs_embeds.shape
        position_ids = torch.arange(n).unsqueeze(0).expand(bsz, -1)
        causal_mask = self._update_causal_mask(inputs_embeds)
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(hidden_states, causal_mask, position_embeddings)
        return self.norm(hidden_states)


def make_granite_hybrid():
    torch.manual_seed(1001)
    model = GraniteMoeHybridModel(GraniteMoeHybridConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, GraniteMoeHybridRMSNorm):
                mod.weight.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {
    "target": "make_granite_hybrid",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "layers.0.self_attn",
    "structure": {
        "heads": 4,
        "kv_heads": 2,
        "head_dim": 16,
        "causal": True,
        "cross": False,
        "rope": {"pairing": "half", "fraction": 1.0, "base": 10000},
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "HF GraniteMoeHybrid attention layer in a decoder body: scale from config.attention_multiplier (0.25 = head_dim**-0.5), "
    "GQA 4:2 repeat_kv, model-built cos/sin and triu finfo.min additive mask, residual_multiplier",
}

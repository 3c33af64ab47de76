"""X-Codec2 / Llasa (HKUST-Audio): X-Codec2 backbone / Llasa attention as in the Hugging Face port (LlamaAttention with bias): q/k/v/o projections with bias, rotate_half rotary from a model-level rotary embedding built in float64 and cast, repeat_kv for grouped heads, RMSNorm pre-norm decoder layer with a bias-free fc1/fc2 MLP.

This file: one bug: value_states = self.k_proj(hidden_states): values come from the key projection (copy-paste)."""

import torch
import torch.nn.functional as F
from torch import nn


class XCodec2Config:
    hidden_size = 64
    num_attention_heads = 4
    num_key_value_heads = 4
    head_dim = 16
    rope_theta = 10000.0
    attention_bias = True
    rms_norm_eps = 1e-6
    is_causal = True


class XCodec2RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states


class XCodec2RotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.head_dim = config.head_dim
        self.base = config.rope_theta

    @torch.no_grad()
    def forward(self, x, position_ids):
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.head_dim, 2, dtype=torch.float64, device=x.device) / self.head_dim))
        freqs = position_ids[..., None].to(torch.float64) * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class XCodec2Attention(nn.Module):
    def __init__(self, config, layer_idx=0):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.is_causal = config.is_causal
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=config.attention_bias)

    def forward(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)

        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)

        attn_output = F.scaled_dot_product_attention(
            query_states,
            key_states,
            value_states,
            attn_mask=attention_mask,
            dropout_p=0.0,
            scale=self.scaling,
            is_causal=self.is_causal and attention_mask is None and query_states.shape[2] > 1,
        )
        attn_output = attn_output.transpose(1, 2).reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output)


class XCodec2DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx=0):
        super().__init__()
        self.self_attn = XCodec2Attention(config, layer_idx)
        self.input_layernorm = XCodec2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = XCodec2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.fc1 = nn.Linear(config.hidden_size, 4 * config.hidden_size, bias=False)
        self.fc2 = nn.Linear(4 * config.hidden_size, config.hidden_size, bias=False)

    def forward(self, hidden_states, position_embeddings, attention_mask=None):
        residual = hidden_states
        hidden_states = self.self_attn(
            self.input_layernorm(hidden_states), position_embeddings=position_embeddings, attention_mask=attention_mask
        )
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.fc2(F.silu(self.fc1(self.post_attention_layernorm(hidden_states))))
        return residual + hidden_states


class XCodec2Backbone(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList([XCodec2DecoderLayer(config, 0)])
        self.norm = XCodec2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = XCodec2RotaryEmbedding(config)

    def forward(self, inputs_embeds):
        seq_len = inputs_embeds.shape[1]
        position_ids = torch.arange(seq_len, device=inputs_embeds.device)[None, :]
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        attention_mask = None
        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_embeddings, attention_mask=attention_mask)
        return self.norm(hidden_states)


def make_xcodec2_backbone():
    torch.manual_seed(4742)
    model = XCodec2Backbone(XCodec2Config())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, XCodec2RMSNorm):
                mod.weight.uniform_(0.5, 1.5)
            elif isinstance(mod, nn.Linear) and mod.bias is not None:
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()

EXPECT = {
    "target": "make_xcodec2_backbone",
    "kind": "causal-multihead",
    "ok": False,
    "layer": "layers.0.self_attn",
    "stage": "values",
    "mistake": "wrong_projection",
    "style": "X-Codec2 / Llasa (HKUST-Audio) (b16_values_from_k_proj): (base c07) one bug: value_states = self.k_proj(hidden_states): values come from the key projection (copy-paste)"
}

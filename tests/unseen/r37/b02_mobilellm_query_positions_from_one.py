"""MobileLLM (facebookresearch/MobileLLM, Llama-derived deep-and-thin decoder; MobileLLM-Pro
local/global layer types): LlamaAttention-style q/k/v/o projections, grouped-query attention by
repeat_kv, rotate_half RoPE with tables built in float64, RMSNorm pre-norm block with SwiGLU,
model-built additive masks per layer type (full causal or causal sliding window), eager or SDPA
core.

This file: one bug: query position_ids = arange(1, n + 1) (next-token positions) while the keys
are rotated at arange(kv_len): queries one position ahead of keys"""

import torch
from torch import nn
from torch.nn import functional as F


class MobileLLMConfig:
    hidden_size = 64
    intermediate_size = 160
    num_attention_heads = 4
    num_key_value_heads = 2
    head_dim = 16
    rope_theta = 10000.0
    rms_norm_eps = 1e-5
    attention_bias = False
    sliding_window = None
    layer_types = ["full_attention"]
    attn_implementation = "eager"


class MobileLLMRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.promote_types(input_dtype, torch.float32))
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class MobileLLMRotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        dim = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x, position_ids):
        freqs = position_ids[:, :, None].to(torch.float64) * self.inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, q_cos, q_sin, k_cos, k_sin):
    q_cos, q_sin = q_cos.unsqueeze(1), q_sin.unsqueeze(1)
    k_cos, k_sin = k_cos.unsqueeze(1), k_sin.unsqueeze(1)
    q_embed = (q * q_cos) + (rotate_half(q) * q_sin)
    k_embed = (k * k_cos) + (rotate_half(k) * k_sin)
    return q_embed, k_embed


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(
        batch, num_key_value_heads, n_rep, slen, head_dim
    )
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


def eager_attention_forward(module, query, key, value, attention_mask, scaling):
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    attn_weights = attn_weights + attention_mask
    attn_weights = F.softmax(
        attn_weights, dim=-1, dtype=torch.promote_types(query.dtype, torch.float32)
    ).to(query.dtype)
    attn_output = torch.matmul(attn_weights, value_states)
    return attn_output.transpose(1, 2).contiguous()


def sdpa_attention_forward(module, query, key, value, attention_mask, scaling):
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)
    attn_output = F.scaled_dot_product_attention(
        query, key_states, value_states, attn_mask=attention_mask, scale=scaling
    )
    return attn_output.transpose(1, 2).contiguous()


ATTENTION_FUNCTIONS = {"eager": eager_attention_forward, "sdpa": sdpa_attention_forward}


class MobileLLMAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.attention_type = config.layer_types[layer_idx]
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.sliding_window = (
            config.sliding_window if self.attention_type == "sliding_attention" else None
        )
        self.q_proj = nn.Linear(
            config.hidden_size,
            config.num_attention_heads * self.head_dim,
            bias=config.attention_bias,
        )
        self.k_proj = nn.Linear(
            config.hidden_size,
            config.num_key_value_heads * self.head_dim,
            bias=config.attention_bias,
        )
        self.v_proj = nn.Linear(
            config.hidden_size,
            config.num_key_value_heads * self.head_dim,
            bias=config.attention_bias,
        )
        self.o_proj = nn.Linear(
            config.num_attention_heads * self.head_dim, config.hidden_size, bias=False
        )
        self.rotary_emb = MobileLLMRotaryEmbedding(config)

    def forward(self, hidden_states, position_ids, attention_mask):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

        kv_position_ids = torch.arange(key_states.shape[2], device=hidden_states.device).unsqueeze(
            0
        )
        q_cos, q_sin = self.rotary_emb(hidden_states, position_ids)
        k_cos, k_sin = self.rotary_emb(hidden_states, kv_position_ids)
        query_states, key_states = apply_rotary_pos_emb(
            query_states, key_states, q_cos, q_sin, k_cos, k_sin
        )

        attention_interface = ATTENTION_FUNCTIONS[self.config.attn_implementation]
        attn_output = attention_interface(
            self, query_states, key_states, value_states, attention_mask, self.scaling
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output)


class MobileLLMMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MobileLLMDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.attention_type = config.layer_types[layer_idx]
        self.self_attn = MobileLLMAttention(config, layer_idx)
        self.mlp = MobileLLMMLP(config)
        self.input_layernorm = MobileLLMRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = MobileLLMRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states, position_ids, attention_mask):
        residual = hidden_states
        hidden_states = self.self_attn(
            self.input_layernorm(hidden_states), position_ids, attention_mask
        )
        hidden_states = residual + hidden_states
        residual = hidden_states
        return residual + self.mlp(self.post_attention_layernorm(hidden_states))


def build_causal_mask(seq_len, dtype, device, sliding_window=None):
    i = torch.arange(seq_len, device=device)[:, None]
    j = torch.arange(seq_len, device=device)[None, :]
    allowed = j <= i
    if sliding_window is not None:
        allowed = allowed & ((i - j) < sliding_window)
    mask = torch.zeros(seq_len, seq_len, dtype=dtype, device=device)
    mask = mask.masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


class MobileLLMModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList([MobileLLMDecoderLayer(config, 0)])
        self.norm = MobileLLMRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, inputs_embeds):
        seq_len = inputs_embeds.shape[1]
        dtype, device = inputs_embeds.dtype, inputs_embeds.device
        position_ids = torch.arange(1, seq_len + 1, device=device).unsqueeze(0)
        causal_mask_mapping = {
            "full_attention": build_causal_mask(seq_len, dtype, device),
            "sliding_attention": build_causal_mask(
                seq_len, dtype, device, self.config.sliding_window
            ),
        }
        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(
                hidden_states, position_ids, causal_mask_mapping[layer.attention_type]
            )
        return self.norm(hidden_states)


def make_mobilellm_model():
    torch.manual_seed(3784)
    model = MobileLLMModel(MobileLLMConfig())
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                param.uniform_(0.5, 1.5)
            elif name.endswith("_proj.bias"):
                param.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {
    "target": "make_mobilellm_model",
    "kind": "causal-multihead",
    "ok": False,
    "layer": "layers.0.self_attn",
    "stage": "rotated_queries",
    "mistake": "rope_positions",
    "style": "MobileLLM MobileLLMAttention: one bug: query position_ids = arange(1, n + 1) "
    "(next-token positions) while the keys are rotated at arange(kv_len): queries "
    "one position ahead of keys",
}

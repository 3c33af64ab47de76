"""Meta Code World Model (HF transformers models/cwm/modeling_cwm.py, facebookresearch/cwm): a
Llama-3-style decoder whose layers alternate between full and sliding-window attention (layer_types),
CwmAttention with q/k/v/o projections, rotate_half RoPE, repeat_kv for grouped kv heads, eager
attention over a boolean mask that the model builds per layer type (sliding_window_overlay:
q - window < k <= q), float32-or-wider softmax upcast, pre-norm RMSNorm block.

This file: one bug: eager_attention_forward fills the hidden scores with 0.0 (masked_fill(~attention_mask, 0.0), as if they were weights) instead of finfo.min"""

import torch
from torch import nn


class CwmConfig:
    hidden_size = 64
    intermediate_size = 128
    num_attention_heads = 4
    num_key_value_heads = 2
    head_dim = 16
    rope_theta = 1000000.0
    rms_norm_eps = 1e-5
    sliding_window = 6
    layer_types = ("sliding_attention",)


class CwmRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        compute = torch.promote_types(input_dtype, torch.float32)
        hidden_states = hidden_states.to(compute)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class CwmRotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        dim = config.head_dim
        inv_freq = 1.0 / (
            config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        )
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x, position_ids):
        inv_freq_expanded = self.inv_freq.to(torch.float64)[None, :, None].expand(position_ids.shape[0], -1, 1)
        position_ids_expanded = position_ids[:, None, :].to(torch.float64)
        freqs = (inv_freq_expanded @ position_ids_expanded).transpose(1, 2)
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
    hidden_states = hidden_states[:, :, None, :, :].expand(
        batch, num_key_value_heads, n_rep, slen, head_dim
    )
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


def eager_attention_forward(module, query, key, value, attention_mask, scaling):
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights.masked_fill(~attention_mask, 0.0)
    softmax_dtype = torch.promote_types(query.dtype, torch.float32)
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=softmax_dtype).to(query.dtype)
    attn_output = torch.matmul(attn_weights, value_states)
    return attn_output.transpose(1, 2).contiguous()


class CwmAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.sliding_window = (
            config.sliding_window
            if config.layer_types[layer_idx] == "sliding_attention"
            else None
        )
        self.q_proj = nn.Linear(
            config.hidden_size, config.num_attention_heads * self.head_dim, bias=False
        )
        self.k_proj = nn.Linear(
            config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False
        )
        self.v_proj = nn.Linear(
            config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False
        )
        self.o_proj = nn.Linear(
            config.num_attention_heads * self.head_dim, config.hidden_size, bias=False
        )

    def forward(self, hidden_states, position_embeddings, attention_mask=None):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        attn_output = eager_attention_forward(
            self, query_states, key_states, value_states, attention_mask, self.scaling
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output)


class CwmMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class CwmDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.attention_type = config.layer_types[layer_idx]
        self.self_attn = CwmAttention(config, layer_idx)
        self.mlp = CwmMLP(config)
        self.input_layernorm = CwmRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = CwmRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask=None):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = self.self_attn(hidden_states, position_embeddings, attention_mask)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.mlp(self.post_attention_layernorm(hidden_states))
        return residual + hidden_states


def causal_mask(seq_len, device):
    q_idx = torch.arange(seq_len, device=device)[:, None]
    kv_idx = torch.arange(seq_len, device=device)[None, :]
    return (kv_idx <= q_idx)[None, None]


def sliding_window_causal_mask(seq_len, sliding_window, device):
    q_idx = torch.arange(seq_len, device=device)[:, None]
    kv_idx = torch.arange(seq_len, device=device)[None, :]
    overlay = kv_idx > q_idx - sliding_window
    return ((kv_idx <= q_idx) & overlay)[None, None]


class CwmModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList([CwmDecoderLayer(config, 0)])
        self.norm = CwmRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = CwmRotaryEmbedding(config)

    def forward(self, inputs_embeds):
        seq_len = inputs_embeds.shape[1]
        device = inputs_embeds.device
        position_ids = torch.arange(seq_len, device=device).unsqueeze(0)
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        mask_mapping = {
            "full_attention": causal_mask(seq_len, device),
            "sliding_attention": sliding_window_causal_mask(
                seq_len, self.config.sliding_window, device
            ),
        }
        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(
                hidden_states, position_embeddings, mask_mapping[layer.attention_type]
            )
        return self.norm(hidden_states)


def make_cwm_model():
    torch.manual_seed(3512)
    model = CwmModel(CwmConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, CwmRMSNorm):
                mod.weight.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {
    "target": "make_cwm_model",
    "kind": "causal-multihead",
    "ok": False,
    "layer": "layers.0.self_attn",
    "stage": "masked_scores",
    "mistake": "mask_fill_value",
    "style": "Meta CWM CwmAttention (HF models/cwm/modeling_cwm.py): one bug: eager_attention_forward fills the hidden scores with 0.0 (masked_fill(~attention_mask, 0.0), as if they were weights) instead of finfo.min",
}

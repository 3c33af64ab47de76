"""Time-MoE decoder attention (in the manner of Maple728/Time-MoE
time_moe/models/modeling_time_moe.py, TimeMoeAttention, Qwen2-style): separate q/k/v projections
with bias, o_proj without, rotate_half RoPE from a model-level rotary table, repeat_kv for
grouped kv heads, eager softmax upcast with promote_types (float64 stays float64) or
F.scaled_dot_product_attention, and an additive finfo.min causal (optionally sliding-window) mask
built once by the model. Pre-RMSNorm block with a SwiGLU MLP (the MoE experts reduced to one
dense expert).

This file: correct (GQA 4:2 of 16, rope_theta 500000, SDPA with the additive mask and explicit
scale)."""

import torch
import torch.nn.functional as F
from torch import nn


class TimeMoeConfig:
    hidden_size = 64
    intermediate_size = 128
    num_attention_heads = 4
    num_key_value_heads = 2
    rope_theta = 500000.0
    rms_norm_eps = 1e-6
    use_sliding_window = False
    sliding_window = 16
    max_window_layers = 0
    use_sdpa = True


class TimeMoeRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class TimeMoeRotaryEmbedding(nn.Module):
    def __init__(self, dim, base):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x, seq_len):
        t = torch.arange(seq_len, dtype=torch.float64)
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    cos = cos[None, None]
    sin = sin[None, None]
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(
        batch, num_key_value_heads, n_rep, slen, head_dim
    )
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class TimeMoeAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.use_sdpa = config.use_sdpa
        self.sliding_window = config.sliding_window if config.use_sliding_window else None
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(
            config.hidden_size, self.num_key_value_heads * self.head_dim, bias=True
        )
        self.v_proj = nn.Linear(
            config.hidden_size, self.num_key_value_heads * self.head_dim, bias=True
        )
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states, position_embeddings, attention_mask):
        bsz, q_len, _ = hidden_states.shape
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

        if self.use_sdpa:
            attn_output = F.scaled_dot_product_attention(
                query_states, key_states, value_states, attn_mask=attention_mask, scale=self.scaling
            )
        else:
            attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.scaling
            attn_weights = attn_weights + attention_mask
            upcast = torch.promote_types(attn_weights.dtype, torch.float32)
            attn_weights = F.softmax(attn_weights, dim=-1, dtype=upcast).to(query_states.dtype)
            attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, -1)
        return self.o_proj(attn_output)


class TimeMoeMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TimeMoeDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = TimeMoeAttention(config, layer_idx)
        self.ffn_layer = TimeMoeMLP(config)
        self.input_layernorm = TimeMoeRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = TimeMoeRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask):
        residual = hidden_states
        hidden_states = self.self_attn(
            self.input_layernorm(hidden_states), position_embeddings, attention_mask
        )
        hidden_states = residual + hidden_states
        return hidden_states + self.ffn_layer(self.post_attention_layernorm(hidden_states))


def build_attention_mask(seq_len, dtype, sliding_window):
    i = torch.arange(seq_len)[:, None]
    j = torch.arange(seq_len)[None, :]
    allowed = j <= i
    if sliding_window is not None:
        allowed = allowed & (i - j < sliding_window)
    mask = torch.zeros(seq_len, seq_len, dtype=dtype)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


class TimeMoeModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList([TimeMoeDecoderLayer(config, 0)])
        self.norm = TimeMoeRMSNorm(config.hidden_size, config.rms_norm_eps)
        head_dim = config.hidden_size // config.num_attention_heads
        self.rotary_emb = TimeMoeRotaryEmbedding(head_dim, config.rope_theta)

    def forward(self, inputs_embeds):
        seq_len = inputs_embeds.shape[1]
        position_embeddings = self.rotary_emb(inputs_embeds, seq_len)
        hidden_states = inputs_embeds
        for layer_idx, layer in enumerate(self.layers):
            window = None
            if self.config.use_sliding_window and layer_idx >= self.config.max_window_layers:
                window = self.config.sliding_window
            mask = build_attention_mask(seq_len, inputs_embeds.dtype, window)
            hidden_states = layer(hidden_states, position_embeddings, mask)
        return self.norm(hidden_states)


def make_time_moe_model():
    torch.manual_seed(3605)
    model = TimeMoeModel(TimeMoeConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, TimeMoeRMSNorm):
                mod.weight.uniform_(0.5, 1.5)
            if isinstance(mod, nn.Linear) and mod.bias is not None:
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {
    "target": "make_time_moe_model",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "layers.0.self_attn",
    "structure": {
        "heads": 4,
        "kv_heads": 2,
        "head_dim": 16,
        "causal": True,
        "cross": False,
        "rope": {"pairing": "half", "fraction": 1.0, "base": 500000},
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "Time-MoE TimeMoeAttention: correct (GQA 4:2 of 16, rope_theta 5e5, "
    "F.scaled_dot_product_attention with the model's additive mask)",
}

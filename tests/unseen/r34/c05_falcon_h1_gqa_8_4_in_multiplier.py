"""TII Falcon-H1 (HF transformers models/falcon_h1/modeling_falcon_h1.py): hybrid decoder layer in which
the attention and the SSM branch read the same normed input in parallel; FalconH1Attention is
Llama-like (q/k/v/o projections, rotate_half RoPE with a very large rope_theta, repeat_kv) but scales
its keys by config.key_multiplier right after the projection, and the layer scales the attention
input by attention_in_multiplier and its output by attention_out_multiplier (muP multipliers).
The Mamba-2 branch is replaced here by a small causal depthwise-conv mixer so the block stays causal.

This file: correct (GQA 8:4 of 8, rope_theta 1e6, key_multiplier 1.0, attention_in_multiplier 0.5 on the layer input, attention_out_multiplier 1.25)"""

import torch
from torch import nn


class FalconH1Config:
    hidden_size = 64
    intermediate_size = 128
    num_attention_heads = 8
    num_key_value_heads = 4
    head_dim = 8
    rope_theta = 1000000.0
    rms_norm_eps = 1e-5
    key_multiplier = 1.0
    attention_in_multiplier = 0.5
    attention_out_multiplier = 1.25
    ssm_out_multiplier = 0.5
    conv_kernel = 4


class FalconH1RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states


class FalconH1RotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        dim = config.head_dim
        inv_freq = 1.0 / (
            config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float64) / dim)
        )
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x, position_ids):
        freqs = position_ids[:, :, None].to(torch.float64) * self.inv_freq.to(torch.float64)[None, None, :]
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


class FalconH1Attention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.key_multiplier = config.key_multiplier
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
        key_states = (
            self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2) * self.key_multiplier
        )
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)

        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.scaling
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        upcast = torch.promote_types(query_states.dtype, torch.float32)
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=upcast).to(
            query_states.dtype
        )
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).contiguous()
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        attn_output = self.o_proj(attn_output)
        return attn_output


class FalconH1ConvMixer(nn.Module):
    """Stand-in for the Mamba-2 mixer: causal depthwise conv + gated projection."""

    def __init__(self, config):
        super().__init__()
        self.in_proj = nn.Linear(config.hidden_size, 2 * config.hidden_size, bias=False)
        self.conv1d = nn.Conv1d(
            config.hidden_size,
            config.hidden_size,
            config.conv_kernel,
            groups=config.hidden_size,
            padding=config.conv_kernel - 1,
        )
        self.out_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, x):
        seq_len = x.shape[1]
        xs, gate = self.in_proj(x).chunk(2, dim=-1)
        xs = self.conv1d(xs.transpose(1, 2))[..., :seq_len].transpose(1, 2)
        return self.out_proj(nn.functional.silu(xs) * nn.functional.silu(gate))


class FalconH1MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class FalconH1DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.mamba = FalconH1ConvMixer(config)
        self.self_attn = FalconH1Attention(config, layer_idx)
        self.feed_forward = FalconH1MLP(config)
        self.input_layernorm = FalconH1RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.pre_ff_layernorm = FalconH1RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask=None):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        mamba_hidden_states = self.mamba(hidden_states) * self.config.ssm_out_multiplier
        attention_hidden_states = self.self_attn(
            hidden_states * self.config.attention_in_multiplier,
            position_embeddings,
            attention_mask,
        )
        attention_hidden_states = attention_hidden_states * self.config.attention_out_multiplier
        hidden_states = residual + mamba_hidden_states + attention_hidden_states
        residual = hidden_states
        hidden_states = self.feed_forward(self.pre_ff_layernorm(hidden_states))
        return residual + hidden_states


class FalconH1Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList([FalconH1DecoderLayer(config, 0)])
        self.final_layernorm = FalconH1RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = FalconH1RotaryEmbedding(config)

    def forward(self, inputs_embeds):
        seq_len = inputs_embeds.shape[1]
        dtype, device = inputs_embeds.dtype, inputs_embeds.device
        position_ids = torch.arange(seq_len, device=device).unsqueeze(0)
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        min_dtype = torch.finfo(dtype).min
        causal = torch.full((seq_len, seq_len), min_dtype, dtype=dtype, device=device)
        causal = torch.triu(causal, diagonal=1)[None, None]
        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_embeddings, causal)
        return self.final_layernorm(hidden_states)


def make_falcon_h1_model():
    torch.manual_seed(3428)
    model = FalconH1Model(FalconH1Config())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, FalconH1RMSNorm):
                mod.weight.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {
    "target": "make_falcon_h1_model",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "layers.0.self_attn",
    "structure": {
        "heads": 8,
        "kv_heads": 4,
        "head_dim": 8,
        "causal": True,
        "cross": False,
        "rope": {"pairing": "half", "fraction": 1.0, "base": 1000000},
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "TII Falcon-H1 FalconH1Attention (HF models/falcon_h1/modeling_falcon_h1.py): correct (GQA 8:4 of 8, rope_theta 1e6, key_multiplier 1.0, attention_in_multiplier 0.5 on the layer input, attention_out_multiplier 1.25)",
}

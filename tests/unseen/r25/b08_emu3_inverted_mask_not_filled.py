"""Hugging Face Emu3 (BAAI, Emu3TextModel / Emu3Attention): separate q/k/v/o projections without bias,
(*input_shape, -1, head_dim) views transposed to (B, H, T, D), Emu3RotaryEmbedding with rotate_half
(theta 1e6), the SDPA path of the attention interface (scaled_dot_product_attention with
enable_gqa=True instead of repeat_kv, scale=self.scaling), additive causal mask built by the model,
input_layernorm / post_attention_layernorm RMSNorm and a SwiGLU MLP.

This file: one bug: the model's additive mask is the inverted 0/1 matrix itself (future keys get +1, not finfo.min)."""

import torch
import torch.nn.functional as F
from torch import nn


class Emu3TextConfig:
    hidden_size = 64
    intermediate_size = 128
    num_attention_heads = 4
    num_key_value_heads = 2
    rope_theta = 1000000.0
    rope_scaling = None
    rms_norm_eps = 1e-5
    attention_bias = False


class Emu3RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states


class Emu3RotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        dim = config.hidden_size // config.num_attention_heads
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        if config.rope_scaling is not None and config.rope_scaling["rope_type"] == "linear":
            inv_freq = inv_freq / config.rope_scaling["factor"]
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


def sdpa_attention_forward(module, query, key, value, attention_mask, scaling):
    # the attention interface's SDPA path: GQA handled by the kernel (enable_gqa), no repeat_kv
    is_causal = attention_mask is None and query.shape[2] > 1
    attn_output = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=0.0, scale=scaling,
        is_causal=is_causal, enable_gqa=True,
    )
    return attn_output.transpose(1, 2).contiguous()


class Emu3Attention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.is_causal = True
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=config.attention_bias)

    def forward(self, hidden_states, position_embeddings, attention_mask=None):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        attn_output = sdpa_attention_forward(self, query_states, key_states, value_states, attention_mask, self.scaling)
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        attn_output = self.o_proj(attn_output)
        return attn_output


class Emu3MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Emu3DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = Emu3Attention(config, layer_idx)
        self.mlp = Emu3MLP(config)
        self.input_layernorm = Emu3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Emu3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask=None):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = self.self_attn(hidden_states, position_embeddings, attention_mask=attention_mask)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.mlp(self.post_attention_layernorm(hidden_states))
        return residual + hidden_states


def build_causal_mask(seq_len, dtype, device):
    # 4-D mask from a 0/1 causal matrix; the masked_fill(min_dtype) step was lost in a refactor
    allowed = torch.tril(torch.ones(seq_len, seq_len, dtype=dtype, device=device))
    inverted_mask = 1.0 - allowed
    return inverted_mask[None, None, :, :]


class Emu3TextModel(nn.Module):
    """Takes inputs_embeds (B, T, hidden_size)."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList([Emu3DecoderLayer(config, 0)])
        self.norm = Emu3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Emu3RotaryEmbedding(config)

    def forward(self, inputs_embeds):
        seq_len = inputs_embeds.shape[1]
        cache_position = torch.arange(seq_len, device=inputs_embeds.device)
        position_ids = cache_position.unsqueeze(0)
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        causal_mask = build_causal_mask(seq_len, inputs_embeds.dtype, inputs_embeds.device)
        hidden_states = inputs_embeds
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(hidden_states, position_embeddings, attention_mask=causal_mask)
        return self.norm(hidden_states)


def make_emu3_text():
    torch.manual_seed(2518)
    model = Emu3TextModel(Emu3TextConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, Emu3RMSNorm):
                mod.weight.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {
    "target": "make_emu3_text",
    "kind": "causal-multihead",
    "ok": False,
    "layer": "layers.0.self_attn",
    "stage": "masked_scores",
    "mistake": "mask_fill_value",
    "style": "HF Emu3 model mask: 1 - tril added without masked_fill(finfo.min)",
}

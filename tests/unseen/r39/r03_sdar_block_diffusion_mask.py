"""SDAR (JetAstra, "Synergy of Diffusion and AutoRegression"): a Qwen3-architecture decoder trained to
decode block-wise; run here in its autoregressive mode (block size 1 = plain causal attention).
Qwen3-style attention: per-head RMSNorm q_norm/k_norm on head_dim before rotate_half RoPE, GQA by
repeat_kv, a boolean "may attend" mask built by the model and filled with the dtype minimum.

This file: refused: block_size=4 (SDAR's block-diffusion mask): every token sees its whole block of
4, future tokens in the block included, and all earlier blocks."""

import torch
import torch.nn.functional as F
from torch import nn


class SDARConfig:
    hidden_size = 64
    intermediate_size = 128
    num_attention_heads = 4
    num_key_value_heads = 2
    head_dim = 16
    rope_theta = 1000000.0
    rms_norm_eps = 1e-6
    block_size = 4  # 1: autoregressive decoding
    attn_implementation = "eager"


class SDARRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states


class SDARRotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dim = config.head_dim
        self.base = config.rope_theta

    @torch.no_grad()
    def forward(self, x, position_ids):
        # the table is built in float64 on every call, then cast to the activations' dtype
        exponents = torch.arange(0, self.dim, 2, dtype=torch.float64, device=x.device) / self.dim
        inv_freq = 1.0 / (self.base**exponents)
        freqs = position_ids[:, :, None].to(torch.float64) * inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x, cos, sin):
    return (x * cos.unsqueeze(1)) + (rotate_half(x) * sin.unsqueeze(1))


def repeat_kv(hidden_states, n_rep):
    if n_rep == 1:
        return hidden_states
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    hidden_states = hidden_states[:, :, None].expand(
        batch, num_key_value_heads, n_rep, slen, head_dim
    )
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class SDARAttention(nn.Module):
    def __init__(self, config, layer_idx=0):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
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
        self.q_norm = SDARRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = SDARRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

        cos, sin = position_embeddings
        query_states, key_states = [apply_rope(t, cos, sin) for t in (query_states, key_states)]

        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)

        if self.config.attn_implementation == "sdpa":
            attn_output = F.scaled_dot_product_attention(
                query_states, key_states, value_states, attn_mask=attention_mask, scale=self.scaling
            )
        else:
            attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.scaling
            attn_weights = attn_weights.masked_fill(
                ~attention_mask, torch.finfo(attn_weights.dtype).min
            )
            attn_weights = torch.softmax(attn_weights, dim=-1)
            attn_output = torch.matmul(attn_weights, value_states)

        attn_output = attn_output.transpose(1, 2).reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output)


class SDARMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SDARDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx=0):
        super().__init__()
        self.self_attn = SDARAttention(config, layer_idx)
        self.mlp = SDARMLP(config)
        self.input_layernorm = SDARRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = SDARRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask):
        residual = hidden_states
        hidden_states = self.self_attn(
            self.input_layernorm(hidden_states), position_embeddings, attention_mask
        )
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


def block_attention_mask(seq_len, block_size, device):
    """True where query i may attend key j: every key in the query's own block and earlier blocks."""
    block_ids = torch.arange(seq_len, device=device) // block_size
    return (block_ids[None, :] <= block_ids[:, None])[None, None]


class SDARModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList([SDARDecoderLayer(config, 0)])
        self.norm = SDARRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = SDARRotaryEmbedding(config)

    def forward(self, inputs_embeds):
        bsz, seq_len, _ = inputs_embeds.shape
        position_ids = torch.arange(seq_len, device=inputs_embeds.device)[None].expand(bsz, -1)
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        attention_mask = block_attention_mask(seq_len, self.config.block_size, inputs_embeds.device)
        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_embeddings, attention_mask)
        return self.norm(hidden_states)


def make_sdar_model():
    torch.manual_seed(3906)
    model = SDARModel(SDARConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, SDARRMSNorm):
                mod.weight.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {
    "target": "make_sdar_model",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "layers.0.self_attn",
    "unsupported": "block_causal_mask",
    "style": "SDAR attention (JetAstra, Qwen3-style per-head QK norm, AR mode) (base c06): refused: "
    "block_size=4 (SDAR's block-diffusion mask): every token sees its whole block of 4, "
    "future tokens in the block included, and all earlier blocks",
}

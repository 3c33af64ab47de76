"""ACE-Step 1.5 style attention (AceStepAttention, built on the Qwen3 layout): separate q/k/v/o
projections, per-head RMSNorm on queries and keys (q_norm / k_norm over head_dim), grouped-query heads
expanded by repeat_kv, rotate-half RoPE from a model-level rotary module, and a 4D additive mask that
the model builds once (create_4d_mask: causal and/or sliding window) and hands to every layer.
Eager and SDPA attention interfaces, as in the transformers attention registry.

This file: (base c04) one bug: the cross branch's key/value lines copied from the self branch: k_proj/v_proj applied to hidden_states (the latent stream), so the layer never reads the encoder states"""

import torch
import torch.nn.functional as F
from torch import nn


class AceStepConfig:
    hidden_size = 64
    intermediate_size = 128
    num_attention_heads = 4
    num_key_value_heads = 2
    head_dim = 16
    rope_theta = 1000000.0
    rms_norm_eps = 1e-6
    attention_bias = True
    sliding_window = None
    layer_types = ["full_attention"]
    is_causal = False
    streaming_chunk_size = 4
    _attn_implementation = "sdpa"


class Qwen3RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states


class AceStepRotaryEmbedding(nn.Module):
    """cos/sin tables for rotate-half RoPE, built in float64 on every call and cast."""

    def __init__(self, config):
        super().__init__()
        self.dim = config.head_dim
        self.base = config.rope_theta

    @torch.no_grad()
    def forward(self, x, position_ids):
        exponent = torch.arange(0, self.dim, 2, dtype=torch.float64, device=x.device) / self.dim
        inv_freq = 1.0 / (self.base**exponent)
        freqs = position_ids[:, :, None].to(torch.float64) * inv_freq[None, None, :]
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
        attn_weights = attn_weights + attention_mask[:, :, :, : key_states.shape[-2]]
    attn_weights = F.softmax(attn_weights, dim=-1)
    attn_output = torch.matmul(attn_weights, value_states)
    return attn_output.transpose(1, 2).contiguous()


def sdpa_attention_forward(module, query, key, value, attention_mask, scaling):
    key = repeat_kv(key, module.num_key_value_groups)
    value = repeat_kv(value, module.num_key_value_groups)
    attn_output = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=0.0, scale=scaling, is_causal=False
    )
    return attn_output.transpose(1, 2).contiguous()


ATTENTION_FUNCTIONS = {"eager": eager_attention_forward, "sdpa": sdpa_attention_forward}


class AceStepAttention(nn.Module):
    def __init__(self, config, layer_idx, is_cross_attention=False):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.is_cross_attention = is_cross_attention
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
            config.num_attention_heads * self.head_dim,
            config.hidden_size,
            bias=config.attention_bias,
        )
        # RMS normalisation over the head dimension only (unlike OLMo's full-width norm)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.attention_type = config.layer_types[layer_idx]

    def forward(
        self,
        hidden_states,
        attention_mask=None,
        encoder_hidden_states=None,
        position_embeddings=None,
    ):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)

        if self.is_cross_attention and encoder_hidden_states is not None:
            encoder_hidden_shape = (*encoder_hidden_states.shape[:-1], -1, self.head_dim)
            key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
            value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        else:
            key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
            value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
            if position_embeddings is not None:
                cos, sin = position_embeddings
                query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        attention_interface = ATTENTION_FUNCTIONS[self.config._attn_implementation]
        attn_output = attention_interface(
            self, query_states, key_states, value_states, attention_mask, self.scaling
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output)


class AceStepMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class AceStepEncoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = AceStepAttention(config, layer_idx, is_cross_attention=False)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = AceStepMLP(config)
        self.attention_type = config.layer_types[layer_idx]

    def forward(self, hidden_states, position_embeddings, attention_mask=None):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = self.self_attn(
            hidden_states, attention_mask=attention_mask, position_embeddings=position_embeddings
        )
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.mlp(self.post_attention_layernorm(hidden_states))
        return residual + hidden_states


def create_4d_mask(
    seq_len, dtype, device, sliding_window=None, is_sliding_window=False, is_causal=True
):
    """Additive [1, 1, L, L] mask: 0.0 where a query may look, finfo.min elsewhere."""
    indices = torch.arange(seq_len, device=device)
    diff = indices.unsqueeze(1) - indices.unsqueeze(0)  # query index minus key index
    valid_mask = torch.ones((seq_len, seq_len), device=device, dtype=torch.bool)
    if is_causal:
        valid_mask = valid_mask & (diff >= 0)
    if is_sliding_window and sliding_window is not None:
        # sliding_window counts the visible keys, the query's own key included
        valid_mask = valid_mask & (diff < sliding_window)
    valid_mask = valid_mask[None, None]
    mask_tensor = torch.full(valid_mask.shape, torch.finfo(dtype).min, dtype=dtype, device=device)
    return mask_tensor.masked_fill(valid_mask, 0.0)


class AceStepEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList([AceStepEncoderLayer(config, 0)])
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = AceStepRotaryEmbedding(config)

    def forward(self, inputs_embeds):
        batch, seq_len = inputs_embeds.shape[:2]
        dtype, device = inputs_embeds.dtype, inputs_embeds.device
        position_ids = torch.arange(seq_len, device=device).unsqueeze(0).expand(batch, -1)
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        mask_mapping = {
            "full_attention": create_4d_mask(
                seq_len, dtype, device, is_causal=self.config.is_causal
            ),
            "sliding_attention": create_4d_mask(
                seq_len,
                dtype,
                device,
                sliding_window=self.config.sliding_window,
                is_sliding_window=True,
                is_causal=self.config.is_causal,
            ),
        }
        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(
                hidden_states,
                position_embeddings,
                attention_mask=mask_mapping[layer.attention_type],
            )
        return self.norm(hidden_states)


class AceStepCrossBlock(nn.Module):
    """Decoder sub-layer: the noisy latent stream attends to the encoder's condition states."""

    def __init__(self, config):
        super().__init__()
        self.cross_attn_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.cross_attn = AceStepAttention(config, 0, is_cross_attention=True)

    def forward(self, hidden_states, encoder_hidden_states):
        attn_output = self.cross_attn(
            self.cross_attn_norm(hidden_states), encoder_hidden_states=encoder_hidden_states
        )
        return hidden_states + attn_output


def make_acestep_cross_block():
    torch.manual_seed(4104)
    model = AceStepCrossBlock(AceStepConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, Qwen3RMSNorm):
                mod.weight.uniform_(0.5, 1.5)
            elif isinstance(mod, nn.Linear) and mod.bias is not None:
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {
    "target": "make_acestep_cross_block",
    "kind": "cross",
    "ok": False,
    "layer": "cross_attn",
    "stage": "keys",
    "mistake": "wrong_source",
    "style": "ACE-Step 1.5 AceStepAttention (b02_acestep_cross_kv_from_hidden): (base c04) one bug: "
    "the cross branch's key/value lines copied from the self branch: k_proj/v_proj applied "
    "to hidden_states (the latent stream), so the layer never reads the encoder states",
}

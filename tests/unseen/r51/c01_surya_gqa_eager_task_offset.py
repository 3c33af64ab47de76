"""Surya OCR (datalab-to / VikParuchuri) text decoder attention, after surya/common/surya/decoder:
a Qwen2-style decoder layer (biased q/k/v projections, bias-free o_proj, rotate_half rotary from a
model-level rotary embedding, repeat_kv for grouped heads, eager or SDPA attention interface) and a
cross-attention onto the image encoder's embeddings. Shrunk to hidden 64.
Configuration: 4 query heads, 2 key/value heads, rope_theta 1e4, eager attention, the model builds an additive causal mask (finfo.min above the diagonal) and a rotary table that includes the reserved task-token position (the tokens sit at positions 1..n).

This file: correct (GQA 4:2, rotate_half rotary base 1e4 at positions 1..n, model-built additive causal mask, eager)"""

import torch
from torch import nn
import torch.nn.functional as F


class SuryaDecoderConfig:
    hidden_size = 64
    intermediate_size = 128
    num_attention_heads = 4
    num_key_value_heads = 2
    rope_theta = 10000.0
    partial_rotary_factor = 1.0
    sliding_window = None
    bos_offset = 1  # the processor reserves position 0 for the task token
    rms_norm_eps = 1e-6
    _attn_implementation = "eager"


class SuryaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class SuryaRotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        head_dim = config.hidden_size // config.num_attention_heads
        self.rot_dim = int(head_dim * config.partial_rotary_factor)
        self.base = config.rope_theta

    @torch.no_grad()
    def forward(self, x, position_ids):
        inv_freq = 1.0 / (
            self.base ** (torch.arange(0, self.rot_dim, 2, dtype=torch.float64) / self.rot_dim)
        )
        freqs = position_ids[:, :, None].to(torch.float64) * inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x, cos, sin):
    # cos/sin: (batch, seq, rot_dim); only the first rot_dim features of each head turn
    rot_dim = cos.shape[-1]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    x_rot = (x_rot * cos) + (rotate_half(x_rot) * sin)
    return torch.cat((x_rot, x_pass), dim=-1)


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
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)
    is_causal = attention_mask is None and query.shape[2] > 1 and module.is_causal
    attn_output = F.scaled_dot_product_attention(
        query,
        key_states,
        value_states,
        attn_mask=attention_mask,
        is_causal=is_causal,
        scale=scaling,
    )
    return attn_output.transpose(1, 2).contiguous()


ATTENTION_FUNCTIONS = {"eager": eager_attention_forward, "sdpa": sdpa_attention_forward}


class SuryaAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.is_causal = True
        self.q_proj = nn.Linear(
            config.hidden_size, config.num_attention_heads * self.head_dim, bias=True
        )
        self.k_proj = nn.Linear(
            config.hidden_size, config.num_key_value_heads * self.head_dim, bias=True
        )
        self.v_proj = nn.Linear(
            config.hidden_size, config.num_key_value_heads * self.head_dim, bias=True
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

        # the table covers the task token too; take the rows of the tokens actually present
        cos, sin = position_embeddings
        q_len, k_len = query_states.shape[-2], key_states.shape[-2]
        query_states = apply_rotary(query_states, cos[:, -q_len:], sin[:, -q_len:])
        key_states = apply_rotary(key_states, cos[:, -k_len:], sin[:, -k_len:])

        attention_interface = ATTENTION_FUNCTIONS[self.config._attn_implementation]
        attn_output = attention_interface(
            self, query_states, key_states, value_states, attention_mask, scaling=self.scaling
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output)


class SuryaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SuryaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = SuryaAttention(config, layer_idx)
        self.mlp = SuryaMLP(config)
        self.input_layernorm = SuryaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = SuryaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask=None):
        residual = hidden_states
        hidden_states = self.self_attn(
            self.input_layernorm(hidden_states), position_embeddings, attention_mask
        )
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


def build_decoder_mask(seq_len, dtype, device, sliding_window=None):
    q_idx = torch.arange(seq_len, device=device)[:, None]
    k_idx = torch.arange(seq_len, device=device)[None, :]
    allowed = k_idx <= q_idx
    if sliding_window is not None:
        allowed = allowed & (q_idx - k_idx < sliding_window)
    mask = torch.zeros(seq_len, seq_len, dtype=dtype, device=device)
    mask = mask.masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


class SuryaDecoderModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList([SuryaDecoderLayer(config, 0)])
        self.norm = SuryaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = SuryaRotaryEmbedding(config)

    def forward(self, inputs_embeds):
        bsz, seq_len, _ = inputs_embeds.shape
        total = seq_len + self.config.bos_offset
        position_ids = torch.arange(total, device=inputs_embeds.device)[None].expand(bsz, -1)
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        if self.config._attn_implementation == "sdpa" and self.config.sliding_window is None:
            attention_mask = None  # plain causal: SDPA takes its is_causal path
        else:
            attention_mask = build_decoder_mask(
                seq_len, inputs_embeds.dtype, inputs_embeds.device, self.config.sliding_window
            )
        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_embeddings, attention_mask)
        return self.norm(hidden_states)


def make_surya_decoder():
    torch.manual_seed(5101)
    model = SuryaDecoderModel(SuryaDecoderConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, SuryaRMSNorm):
                mod.weight.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {
    "target": "make_surya_decoder",
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
    "style": "Surya OCR (datalab-to) decoder self-attention: correct (GQA 4:2, rotate_half rotary "
    "base 1e4 at positions 1..n, model-built additive causal mask, eager)",
}

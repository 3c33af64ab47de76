"""Yi (01.AI) YiAttention, Llama-style: q/k/v/o without bias, GQA via repeat_kv, rotate_half RoPE with a
large rope_theta gathered by position_ids, ln1/ln2 decoder layer.

This file: correct. Yi YiAttention with 6 query heads of 8 (48-wide q_proj, o_proj 48->64), GQA 6:2, eager core, model-built causal mask."""

import math

import torch
from torch import nn
from torch.nn import functional as F


class YiConfig:
    hidden_size = 64
    intermediate_size = 128
    num_attention_heads = 6
    num_key_value_heads = 2
    head_dim = 8
    rope_theta = 5000000.0
    rms_norm_eps = 1e-5
    attn_implementation = "eager"


class YiRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states


class YiRotaryEmbedding(nn.Module):
    """cos/sin computed in float64 for the requested length on every call."""

    def __init__(self, dim, base):
        super().__init__()
        self.dim = dim
        self.base = base

    def forward(self, x, seq_len):
        inv_freq = 1.0 / (
            self.base ** (torch.arange(0, self.dim, 2, dtype=torch.float64) / self.dim)
        )
        t = torch.arange(seq_len, dtype=torch.float64)
        freqs = torch.einsum("i,j->ij", t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids):
    cos = cos[position_ids].unsqueeze(1)  # (batch, 1, seq, dim)
    sin = sin[position_ids].unsqueeze(1)
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


class YiAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(
            self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False
        )
        self.v_proj = nn.Linear(
            self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False
        )
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=False)
        self.rotary_emb = YiRotaryEmbedding(self.head_dim, base=config.rope_theta)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None):
        bsz, q_len, _ = hidden_states.size()

        query_states = self.q_proj(hidden_states)
        key_states = self.k_proj(hidden_states)
        value_states = self.v_proj(hidden_states)

        query_states = query_states.view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = key_states.view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(
            1, 2
        )
        value_states = value_states.view(
            bsz, q_len, self.num_key_value_heads, self.head_dim
        ).transpose(1, 2)

        kv_seq_len = key_states.shape[-2]
        if past_key_value is not None:
            kv_seq_len += past_key_value[0].shape[-2]
        cos, sin = self.rotary_emb(value_states, seq_len=int(position_ids.max()) + 1)
        query_states, key_states = apply_rotary_pos_emb(
            query_states, key_states, cos, sin, position_ids
        )

        if past_key_value is not None:
            key_states = torch.cat([past_key_value[0], key_states], dim=2)
            value_states = torch.cat([past_key_value[1], value_states], dim=2)

        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)

        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.scaling
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).contiguous()
        attn_output = attn_output.reshape(bsz, q_len, self.num_heads * self.head_dim)
        return self.o_proj(attn_output)


class YiMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class YiDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = YiAttention(config)
        self.mlp = YiMLP(config)
        self.ln1 = YiRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.ln2 = YiRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask, position_ids):
        residual = hidden_states
        hidden_states = self.self_attn(
            self.ln1(hidden_states), attention_mask=attention_mask, position_ids=position_ids
        )
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.ln2(hidden_states))


def _make_causal_mask(bsz, tgt_len, dtype, device, past_key_values_length=0):
    """Additive (bsz, 1, tgt_len, tgt_len + past) mask: 0 where visible, dtype min elsewhere."""
    mask = torch.full((tgt_len, tgt_len), torch.finfo(dtype).min, dtype=dtype, device=device)
    mask_cond = torch.arange(mask.size(-1), device=device)
    mask.masked_fill_(mask_cond < (mask_cond + 1).view(mask.size(-1), 1), 0)
    if past_key_values_length > 0:
        mask = torch.cat(
            [torch.zeros(tgt_len, past_key_values_length, dtype=dtype, device=device), mask], dim=-1
        )
    return mask[None, None, :, :].expand(bsz, 1, tgt_len, tgt_len + past_key_values_length)


class YiModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList([YiDecoderLayer(config)])
        self.norm = YiRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, inputs_embeds):
        batch_size, seq_length, _ = inputs_embeds.shape
        position_ids = torch.arange(seq_length, device=inputs_embeds.device)
        position_ids = position_ids.unsqueeze(0).expand(batch_size, -1)
        attention_mask = _make_causal_mask(
            batch_size, seq_length, inputs_embeds.dtype, inputs_embeds.device
        )
        hidden_states = inputs_embeds
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(
                hidden_states, attention_mask=attention_mask, position_ids=position_ids
            )
        return self.norm(hidden_states)


def make_yi_model():
    torch.manual_seed(4410)
    model = YiModel(YiConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, YiRMSNorm):
                mod.weight.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {
    "target": "make_yi_model",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "layers.0.self_attn",
    "structure": {
        "heads": 6,
        "kv_heads": 2,
        "head_dim": 8,
        "causal": True,
        "cross": False,
        "rope": {
            "pairing": "half",
            "fraction": 1.0,
            "base": 5000000,
        },
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "Yi (01.AI) (c10): correct: Yi YiAttention with 6 query heads of 8 (48-wide q_proj, o_proj 48->64), GQA 6:2, eager core, model-built causal mask",
}

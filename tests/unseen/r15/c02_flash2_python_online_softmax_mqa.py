"""HF Llama-style decoder (LlamaModel -> LlamaDecoderLayer -> LlamaAttention) whose attention core is a
FlashAttention-2 forward written in plain PyTorch: one pass over key blocks of 8 with a running max,
a running denominator and a rescaled accumulator (online softmax, exact). rotate_half RoPE from a
model-level rotary module passed as position_embeddings=(cos, sin), repeat_kv GQA.

This file: correct (MQA 8:1, head_dim 8)."""

import math

import torch
from torch import nn


class LlamaConfig:
    hidden_size = 64
    intermediate_size = 128
    num_attention_heads = 8
    num_key_value_heads = 1
    head_dim = 8
    rope_theta = 10000.0
    rms_norm_eps = 1e-5
    block_k = 8  # key block of the online-softmax loop


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states


class LlamaRotaryEmbedding(nn.Module):
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


def apply_rotary_pos_emb(q, k, cos, sin):
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
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


def online_softmax_attention(query, key, value, scaling, block_k, causal=True):
    """FlashAttention-2 forward written in Python: one pass over key blocks with a running
    max m_i, running denominator l_i and an unnormalised accumulator, rescaled as the max grows."""
    bsz, heads, q_len, head_dim = query.shape
    k_len = key.shape[2]
    neg = torch.finfo(query.dtype).min
    m_i = torch.full((bsz, heads, q_len, 1), neg, dtype=query.dtype, device=query.device)
    l_i = torch.zeros((bsz, heads, q_len, 1), dtype=query.dtype, device=query.device)
    acc = torch.zeros((bsz, heads, q_len, value.shape[-1]), dtype=query.dtype, device=query.device)
    q_idx = torch.arange(q_len, device=query.device)[:, None] + (k_len - q_len)
    for start in range(0, k_len, block_k):
        end = min(start + block_k, k_len)
        k_blk = key[:, :, start:end]
        v_blk = value[:, :, start:end]
        s = torch.matmul(query, k_blk.transpose(-1, -2)) * scaling
        if causal:
            k_idx = torch.arange(start, end, device=query.device)[None, :]
            s = s.masked_fill(k_idx > q_idx, neg)
        m_new = torch.maximum(m_i, s.amax(dim=-1, keepdim=True))
        alpha = torch.exp(m_i - m_new)
        p = torch.exp(s - m_new)
        l_i = l_i * alpha + p.sum(dim=-1, keepdim=True)
        acc = acc * alpha + torch.matmul(p, v_blk)
        m_i = m_new
    return acc / l_i


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.is_causal = True
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

    def forward(self, hidden_states, position_embeddings):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)

        attn_output = online_softmax_attention(
            query_states,
            key_states,
            value_states,
            self.scaling,
            self.config.block_k,
            causal=self.is_causal,
        )
        attn_output = attn_output.transpose(1, 2).reshape(*input_shape, -1).contiguous()
        attn_output = self.o_proj(attn_output)
        return attn_output


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = self.self_attn(hidden_states, position_embeddings=position_embeddings)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.mlp(self.post_attention_layernorm(hidden_states))
        return residual + hidden_states


class LlamaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, 0)])
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config)

    def forward(self, inputs_embeds):
        position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device)[None, :]
        position_ids = position_ids.expand(inputs_embeds.shape[0], -1)
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_embeddings)
        return self.norm(hidden_states)


def make_llama_online():
    torch.manual_seed(1502)
    model = LlamaModel(LlamaConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, LlamaRMSNorm):
                mod.weight.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {
    "target": "make_llama_online",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "layers.0.self_attn",
    "structure": {
        "heads": 8,
        "kv_heads": 1,
        "head_dim": 8,
        "causal": True,
        "cross": False,
        "rope": {"pairing": "half", "fraction": 1.0, "base": 10000},
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "Llama + FlashAttention-2 online softmax in Python: correct (MQA 8:1, head_dim 8)",
}

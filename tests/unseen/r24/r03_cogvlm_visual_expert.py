"""THUDM CogVLM remote code (VisionExpertAttention): two sets of projections, the vision expert's
(fused query_key_value with bias, dense) for the image tokens and the language expert's for the text
tokens, chosen per token by token_type_ids (here the first 4 tokens are image tokens); rotate_half RoPE
base 10000, causal additive mask, one attention over the mixed sequence.

This file: refused (per-token-type projection experts: queries, keys, values and output are made with
different weights for different tokens)."""

import math

import torch
from torch import nn


class CogVLMConfig:
    hidden_size = 64
    num_attention_heads = 4
    rope_theta = 10000.0
    rms_norm_eps = 1e-5
    num_vision_tokens = 4  # image tokens lead the sequence


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, base):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)), persistent=False)

    def forward(self, x, position_ids):
        freqs = position_ids[..., None].to(torch.float64) * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype)[:, None], emb.sin().to(x.dtype)[:, None]


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class VisionExpertAttention(nn.Module):
    """Each token is projected by the vision expert or the language expert according to its type."""

    def __init__(self, config):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.rotary_emb = RotaryEmbedding(self.head_dim, config.rope_theta)
        self.vision_expert_query_key_value = nn.Linear(self.hidden_size, self.hidden_size * 3, bias=True)
        self.vision_expert_dense = nn.Linear(self.hidden_size, self.hidden_size, bias=False)
        self.language_expert_query_key_value = nn.Linear(self.hidden_size, self.hidden_size * 3, bias=False)
        self.language_expert_dense = nn.Linear(self.hidden_size, self.hidden_size, bias=False)

    def forward(self, hidden_states, token_type_ids, position_ids, attention_mask):
        bsz, q_len, _ = hidden_states.shape
        vision_token_mask = (token_type_ids == 1)[..., None]
        mixed_raw_layer = torch.where(
            vision_token_mask,
            self.vision_expert_query_key_value(hidden_states),
            self.language_expert_query_key_value(hidden_states),
        )
        query_states, key_states, value_states = torch.split(mixed_raw_layer, self.hidden_size, dim=-1)
        query_states = query_states.view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = key_states.view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        value_states = value_states.view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary_emb(value_states, position_ids)
        query_states = query_states * cos + rotate_half(query_states) * sin
        key_states = key_states * cos + rotate_half(key_states) * sin
        scores = torch.matmul(query_states / math.sqrt(self.head_dim), key_states.transpose(-1, -2))
        scores = scores + attention_mask
        context_layer = torch.matmul(torch.softmax(scores, dim=-1), value_states)
        context_layer = context_layer.transpose(1, 2).reshape(bsz, q_len, self.hidden_size)
        return torch.where(
            vision_token_mask,
            self.vision_expert_dense(context_layer),
            self.language_expert_dense(context_layer),
        )


class CogVLMDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = VisionExpertAttention(config)

    def forward(self, x, token_type_ids, position_ids, attention_mask):
        return x + self.self_attn(self.input_layernorm(x), token_type_ids, position_ids, attention_mask)


class CogVLMModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList([CogVLMDecoderLayer(config)])

    def forward(self, inputs_embeds):
        bsz, seq_len, _ = inputs_embeds.shape
        token_type_ids = torch.zeros(bsz, seq_len, dtype=torch.long, device=inputs_embeds.device)
        token_type_ids[:, : self.config.num_vision_tokens] = 1
        position_ids = torch.arange(seq_len, device=inputs_embeds.device).expand(bsz, seq_len)
        mask = torch.full((seq_len, seq_len), torch.finfo(inputs_embeds.dtype).min, dtype=inputs_embeds.dtype, device=inputs_embeds.device)
        mask = torch.triu(mask, diagonal=1)[None, None]
        h = inputs_embeds
        for layer in self.layers:
            h = layer(h, token_type_ids, position_ids, mask)
        return h


def make_cogvlm():
    torch.manual_seed(2462)
    model = CogVLMModel(CogVLMConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, RMSNorm):
                mod.weight.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {'target': 'make_cogvlm',
 'kind': 'causal-multihead',
 'ok': True,
 'layer': 'layers.0.self_attn',
 'unsupported': 'token_type_experts',
 'style': 'CogVLM VisionExpertAttention: vision/language expert projections chosen by token type'}

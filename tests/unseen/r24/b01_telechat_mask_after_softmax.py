"""Tele-AI TeleChat / TeleChat2 remote code (modeling_telechat.py, BLOOM lineage): hidden states
turned sequence-first, a `query` Linear and a fused `key_value` Linear whose per-head rows hold
[key | value], rotate_half RoPE from a RotaryEmbedding with cached cos/sin (sequence-first
[s, 1, 1, d]), kv heads repeated with expand/reshape (TeleChat2 GQA), `torch.baddbmm` with beta=0 and
alpha=1/norm_factor on (b*h) folds, a boolean causal mask built by the model (`_make_causal_mask`) and
filled with finfo.min, softmax, `torch.bmm` with the values, `dense` output projection (with bias).
Pre-norm RMSNorm block with a SwiGLU MLP.

This file: one bug: the probabilities are computed from the unmasked scores and the future entries zeroed afterwards (GQA 4:2)."""

import math

import torch
from torch import nn


class TeleChatConfig:
    hidden_size = 64
    n_head = 4
    num_key_value_heads = 2
    rope_base = 10000.0
    layer_norm_epsilon = 1e-5
    ffn_hidden_size = 128
    training_seqlen = 8
    logn = False


class TeleChatRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


class RotaryEmbedding(nn.Module):
    """Sequence-first cos/sin tables, computed in float64 and cast on use."""

    def __init__(self, dim, base=10000.0):
        super().__init__()
        self.dim = dim
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x, seq_len):
        t = torch.arange(seq_len, dtype=torch.float64, device=x.device)
        freqs = torch.einsum("i,j->ij", t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos_cached = emb.cos()[:, None, None, :].to(x.dtype)
        sin_cached = emb.sin()[:, None, None, :].to(x.dtype)
        return cos_cached, sin_cached


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=x1.ndim - 1)


def apply_rotary_pos_emb(q, k, cos, sin, q_len):
    cos_q, sin_q = cos[:q_len], sin[:q_len]
    cos_k, sin_k = cos[:q_len], sin[:q_len]
    return (q * cos_q) + (rotate_half(q) * sin_q), (k * cos_k) + (rotate_half(k) * sin_k)


class TeleChatAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.num_heads = config.n_head
        self.num_key_value_heads = config.num_key_value_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.kv_projection_size = self.head_dim * self.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.norm_factor = math.sqrt(self.head_dim)
        self.query = nn.Linear(self.hidden_size, self.hidden_size, bias=False)
        self.key_value = nn.Linear(self.hidden_size, 2 * self.kv_projection_size, bias=False)
        self.dense = nn.Linear(self.hidden_size, self.hidden_size)
        self.rotary_emb = RotaryEmbedding(self.head_dim, base=config.rope_base)
        self.logn = config.logn
        self.training_seqlen = config.training_seqlen

    def forward(self, hidden_states, attention_mask):
        hidden_states = hidden_states.transpose(1, 0)  # [s, b, h]
        q_len, bsz, _ = hidden_states.shape
        query_layer = self.query(hidden_states)
        query_layer = query_layer.view(q_len, bsz, self.num_heads, self.head_dim)

        mixed_kv_layer = self.key_value(hidden_states)
        mixed_kv_layer = mixed_kv_layer.view(q_len, bsz, self.num_key_value_heads, 2 * self.head_dim)
        key_layer, value_layer = torch.split(mixed_kv_layer, self.head_dim, dim=-1)

        cos, sin = self.rotary_emb(value_layer, seq_len=q_len)
        query_layer, key_layer = apply_rotary_pos_emb(query_layer, key_layer, cos, sin, q_len)
        if self.num_key_value_groups > 1:
            key_layer = key_layer.unsqueeze(3).expand(
                q_len, bsz, self.num_key_value_heads, self.num_key_value_groups, self.head_dim
            ).reshape(q_len, bsz, self.num_heads, self.head_dim)
            value_layer = value_layer.unsqueeze(3).expand(
                q_len, bsz, self.num_key_value_heads, self.num_key_value_groups, self.head_dim
            ).reshape(q_len, bsz, self.num_heads, self.head_dim)

        query_layer = query_layer.reshape(q_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        key_layer = key_layer.reshape(q_len, bsz * self.num_heads, self.head_dim).permute(1, 2, 0)
        value_layer = value_layer.reshape(q_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)

        matmul_input_buffer = torch.empty(
            bsz * self.num_heads, q_len, q_len, dtype=query_layer.dtype, device=query_layer.device
        )
        matmul_result = torch.baddbmm(
            matmul_input_buffer, query_layer, key_layer, beta=0.0, alpha=1.0 / self.norm_factor
        )
        attention_scores = matmul_result.view(bsz, self.num_heads, q_len, q_len)
        attention_probs = nn.functional.softmax(attention_scores, dim=-1)
        attention_probs = attention_probs.masked_fill(attention_mask, 0.0)

        attention_probs_reshaped = attention_probs.view(bsz * self.num_heads, q_len, q_len)
        context_layer = torch.bmm(attention_probs_reshaped, value_layer)
        context_layer = context_layer.view(bsz, self.num_heads, q_len, self.head_dim)
        context_layer = context_layer.permute(0, 2, 1, 3).reshape(bsz, q_len, self.hidden_size)
        return self.dense(context_layer)


class TeleChatMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.ffn_hidden_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.ffn_hidden_size, bias=False)
        self.down_proj = nn.Linear(config.ffn_hidden_size, config.hidden_size)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class TeleChatBlock(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.input_layernorm = TeleChatRMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.self_attention = TeleChatAttention(config, layer_idx)
        self.post_attention_layernorm = TeleChatRMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.mlp = TeleChatMLP(config)

    def forward(self, hidden_states, attention_mask):
        residual = hidden_states
        attn = self.self_attention(self.input_layernorm(hidden_states), attention_mask)
        hidden_states = residual + attn
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


def _make_causal_mask(bsz, seq_len, device):
    """True where a key is hidden (BLOOM convention)."""
    seq_ids = torch.arange(seq_len, device=device)
    mask = seq_ids[:, None] < seq_ids[None, :]
    return mask[None, None, :, :].expand(bsz, 1, seq_len, seq_len)


class TeleChatTransformer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.h = nn.ModuleList([TeleChatBlock(config, 0)])
        self.ln_f = TeleChatRMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)

    def forward(self, inputs_embeds):
        bsz, seq_len, _ = inputs_embeds.shape
        causal_mask = _make_causal_mask(bsz, seq_len, inputs_embeds.device)
        hidden_states = inputs_embeds
        for block in self.h:
            hidden_states = block(hidden_states, causal_mask)
        return self.ln_f(hidden_states)


def make_telechat():
    torch.manual_seed(2403)
    config = TeleChatConfig()

    model = TeleChatTransformer(config)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, TeleChatRMSNorm):
                mod.weight.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {'target': 'make_telechat',
 'kind': 'causal-multihead',
 'ok': False,
 'layer': 'h.0.self_attention',
 'stage': 'weights',
 'mistake': 'mask_after_softmax',
 'style': 'TeleChat2 attention: softmax first, masked_fill(mask, 0.0) on the probabilities'}

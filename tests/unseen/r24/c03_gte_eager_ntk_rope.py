"""Alibaba-NLP GTE "new-impl" remote code (modeling.py, NewModel / NewAttention, gte-base-en-v1.5 and
gte-multilingual lineage): a BERT-style post-norm encoder with a fused `qkv_proj` (bias) whose output is
viewed (..., 3, heads, head_dim) and unbound on dim -3, rotate_half RoPE on the (b, s, h, d) layout from
cos/sin gathered at `position_ids`, an additive attention bias built by the model from the padding mask
(all ones here), eager matmul attention or SDPA, `o_proj` (bias), `attn_ln` LayerNorm after the residual
and a gated GLU MLP. With `unpad_inputs` the tokens of the batch are packed on one axis and attended
with a block-diagonal mask (the xformers `BlockDiagonalMask` path, written in torch). Not causal.

This file: correct (4x16, eager path, rope_theta 160000 with static NTK factor 2, so the effective base is 160000 * 2**(16/14) = 353308.6444)."""

import math

import torch
from torch import nn
import torch.nn.functional as F


class NewConfig:
    hidden_size = 64
    num_attention_heads = 4
    intermediate_size = 128
    rope_theta = 160000.0
    rope_scaling = {"type": "ntk", "factor": 2.0}
    layer_norm_eps = 1e-12
    max_position_embeddings = 8192
    unpad_inputs = False
    attn_implementation = "eager"


class NTKScalingRotaryEmbedding(nn.Module):
    """Static NTK-aware scaling: the base is raised to base * factor ** (dim / (dim - 2))."""

    def __init__(self, dim, max_position_embeddings, base, scaling_factor=1.0):
        super().__init__()
        self.dim = dim
        base = base * scaling_factor ** (dim / (dim - 2))
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x, seq_len):
        t = torch.arange(seq_len, dtype=torch.float64, device=x.device)
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # (b, s, 1, d) against (b, s, h, d)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


class NewAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.qkv_proj = nn.Linear(config.hidden_size, self.all_head_size * 3, bias=True)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=True)

    def forward(self, hidden_states, attention_bias, rope_embeds, seqlens=None):
        qkv_inputs = self.qkv_proj(hidden_states)
        new_shape = qkv_inputs.size()[:-1] + (3, self.num_attention_heads, self.attention_head_size)
        query_states, key_states, value_states = torch.unbind(qkv_inputs.view(new_shape), dim=-3)

        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, *rope_embeds)

        if seqlens is not None:
            context_layer = self._packed_attention(query_states, key_states, value_states, seqlens)
        elif self.config.attn_implementation == "eager":
            context_layer = self._eager_attention(query_states, key_states, value_states, attention_bias)
        else:
            context_layer = F.scaled_dot_product_attention(
                query_states.transpose(1, 2), key_states.transpose(1, 2), value_states.transpose(1, 2),
                attn_mask=attention_bias,
            ).transpose(1, 2)
        context_layer = context_layer.reshape(*context_layer.shape[:-2], self.all_head_size)
        return self.o_proj(context_layer)

    def _eager_attention(self, query_states, key_states, value_states, attention_bias):
        query_states = query_states.transpose(1, 2)
        key_states = key_states.transpose(1, 2)
        value_states = value_states.transpose(1, 2)
        attention_scores = torch.matmul(query_states, key_states.transpose(-1, -2))
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        attention_scores = attention_scores + attention_bias
        attention_probs = nn.functional.softmax(attention_scores, dim=-1)
        context_layer = torch.matmul(attention_probs, value_states)
        return context_layer.transpose(1, 2)

    def _packed_attention(self, query_states, key_states, value_states, seqlens):
        """Stand-in for xformers memory_efficient_attention with BlockDiagonalMask.from_seqlens."""
        q = query_states.unsqueeze(0).transpose(1, 2)  # (1, h, total, d)
        k = key_states.unsqueeze(0).transpose(1, 2)
        v = value_states.unsqueeze(0).transpose(1, 2)
        seq_ids = torch.repeat_interleave(torch.arange(len(seqlens), device=q.device), torch.tensor(seqlens, device=q.device))
        block_diag = seq_ids[:, None] == seq_ids[None, :]
        attn_bias = torch.zeros(block_diag.shape, dtype=q.dtype, device=q.device)
        attn_bias = attn_bias.masked_fill(~block_diag, torch.finfo(q.dtype).min)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_bias)
        return out.transpose(1, 2).squeeze(0)


class NewGatedMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.up_gate_proj = nn.Linear(config.hidden_size, config.intermediate_size * 2, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=True)

    def forward(self, x):
        up, gate = torch.chunk(self.up_gate_proj(x), 2, dim=-1)
        return self.down_proj(nn.functional.gelu(gate) * up)


class NewLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention = NewAttention(config)
        self.mlp = NewGatedMLP(config)
        self.attn_ln = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp_ln = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states, attention_bias, rope_embeds, seqlens=None):
        hidden_states = self.attn_ln(hidden_states + self.attention(hidden_states, attention_bias, rope_embeds, seqlens))
        return self.mlp_ln(hidden_states + self.mlp(hidden_states))


class NewModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        head_dim = config.hidden_size // config.num_attention_heads
        factor = config.rope_scaling["factor"] if config.rope_scaling else 1.0
        self.rotary_emb = NTKScalingRotaryEmbedding(head_dim, config.max_position_embeddings, config.rope_theta, factor)
        self.encoder = nn.ModuleList([NewLayer(config)])

    def forward(self, inputs_embeds):
        bsz, seq_len, hidden = inputs_embeds.shape
        attention_mask = torch.ones(bsz, seq_len, dtype=inputs_embeds.dtype, device=inputs_embeds.device)
        position_ids = torch.arange(seq_len, device=inputs_embeds.device).expand(bsz, seq_len)
        cos, sin = self.rotary_emb(inputs_embeds, seq_len)
        rope_embeds = (cos[position_ids], sin[position_ids])
        attention_bias = (1.0 - attention_mask[:, None, None, :]) * torch.finfo(inputs_embeds.dtype).min
        hidden_states = inputs_embeds
        if self.config.unpad_inputs:
            keep = attention_mask.bool()
            seqlens = attention_mask.sum(-1).long().tolist()
            packed = hidden_states[keep]
            packed_rope = (rope_embeds[0][keep], rope_embeds[1][keep])
            for layer in self.encoder:
                packed = layer(packed, None, packed_rope, seqlens)
            out = torch.zeros_like(hidden_states)
            out[keep] = packed
            return out
        for layer in self.encoder:
            hidden_states = layer(hidden_states, attention_bias, rope_embeds)
        return hidden_states


def make_gte():
    torch.manual_seed(2411)
    model = NewModel(NewConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {'target': 'make_gte',
 'kind': 'multihead',
 'ok': True,
 'layer': 'encoder.0.attention',
 'structure': {'heads': 4,
               'kv_heads': 4,
               'head_dim': 16,
               'causal': False,
               'cross': False,
               'rope': {'pairing': 'half', 'fraction': 1.0, 'base': 353308.6444},
               'qk_norm': None,
               'window': None,
               'bias': None},
 'style': 'GTE NewAttention eager path: correct (4x16, NTK-scaled rope base 160000*2**(8/7))'}

"""LLaMA with LongLM's Self-Extend patch (datamllab/LongLM self_extend_patch/Llama.py).

SelfExtend replaces LlamaAttention.forward by `self_extend_forward(group_size_1, group_size_2)`:
the cache holds un-rotated keys (HF's cache update happens before the rotation), and every call
rotates the queries and all keys twice, once at their real positions (`neighbor_query_states`,
`neighbor_key_states`) and once at grouped positions (`query_position // group_size_1 + shift`,
`key_position // group_size_1`); the two score matrices are merged with the neighbor scores for keys
closer than group_size_2 and the grouped ones beyond, then masked (finfo.min) and softmaxed.  With the
published defaults here (group_size_1 4, group_size_2 512) every key used is inside the neighbor
window, so the layer is ordinary rotary attention (rotate_half, base 1e4).
Tree: model.embed_tokens, model.layers.N (input_layernorm, self_attn, post_attention_layernorm, mlp),
model.norm, lm_head.  MHA 4 heads, 3 layers.
Cache: hf legacy tuples: `out = model(ids, use_cache=True)`, then
`model(tok, past_key_values=out.past_key_values, use_cache=True)`; logits in `out.logits`.
Decode bug: the patch was adapted to an older transformers whose cache update came after the rotation
(`cache_rotated_keys`), so the tuple stores `neighbor_key_states` (already rotated) while the next call
still rotates every key it gets from the cache: cached keys are rotated twice (position p as 2p).
Nothing raises.  The key at position 0 is unaffected, so with a 1-token prompt the first divergence is
step 1.  The prompt pass and the full forward are exact.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": [
        "model.layers.0.self_attn",
        "model.layers.1.self_attn",
        "model.layers.2.self_attn",
    ],
    "kind": "causal-multihead",
    "cache": "hf",
    "decode": {
        "mistake": "cache_other",
        "step": 0,
        "layer": "model.layers.0.self_attn",
    },
    "style": "LongLM Self-Extend llama: neighbor and grouped rotary scores merged by distance < group_size_2 "
    "(all neighbor here), un-rotated keys expected in the legacy tuple cache; decode bug: the cache stores the "
    "already rotated neighbor keys, which are rotated again on the next step (prompts >= 2 tokens)",
}


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class LlamaRotaryEmbedding(nn.Module):
    def __init__(self, dim, base=10000.0):
        super().__init__()
        self.dim = dim
        self.base = base

    def forward(self, x, seq_len):
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2, dtype=torch.float64) / self.dim))
        freqs = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1).to(x.device)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(x, cos, sin, position_ids):
    # LongLM's single-tensor variant: rotate x at the given (batch, len) positions
    cos = cos[position_ids].unsqueeze(1)
    sin = sin[position_ids].unsqueeze(1)
    return (x * cos) + (rotate_half(x) * sin)


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.q_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=False)
        self.k_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=False)
        self.v_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=False)
        self.o_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(self.head_dim)
        self.cache_rotated_keys = config.cache_rotated_keys

    def forward(self, hidden_states, position_ids, past_key_value=None, use_cache=False,
                group_size_1=4, group_size_2=512):
        bsz, q_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)

        if past_key_value is not None:
            key_states = torch.cat([past_key_value[0], key_states], dim=2)
            value_states = torch.cat([past_key_value[1], value_states], dim=2)
        kv_seq_len = key_states.shape[-2]
        if self.cache_rotated_keys:
            past_key_value = None  # filled below, after the rotation
        else:
            past_key_value = (key_states, value_states) if use_cache else None

        query_position = position_ids
        key_position = torch.arange(kv_seq_len, device=position_ids.device).unsqueeze(0).expand(bsz, -1)
        cos, sin = self.rotary_emb(value_states, seq_len=kv_seq_len)

        neighbor_query_states = apply_rotary_pos_emb(query_states, cos, sin, query_position)
        neighbor_key_states = apply_rotary_pos_emb(key_states, cos, sin, key_position)
        _re_group_size_2 = 0 if int(query_position.max()) < group_size_2 else group_size_2
        group_query_position = query_position // group_size_1 + _re_group_size_2 - _re_group_size_2 // group_size_1
        group_key_position = key_position // group_size_1
        group_query_states = apply_rotary_pos_emb(query_states, cos, sin, group_query_position)
        group_key_states = apply_rotary_pos_emb(key_states, cos, sin, group_key_position)
        if self.cache_rotated_keys and use_cache:
            past_key_value = (neighbor_key_states, value_states)

        neighbor_attn_weights = torch.matmul(neighbor_query_states, neighbor_key_states.transpose(2, 3)) / math.sqrt(self.head_dim)
        group_attn_weights = torch.matmul(group_query_states, group_key_states.transpose(2, 3)) / math.sqrt(self.head_dim)

        # keys closer than group_size_2 use the neighbor (exact) positions, farther ones the grouped ones
        distance = query_position[:, None, :, None] - key_position[:, None, None, :]
        neighbor_attention_mask = distance < group_size_2
        causal = distance >= 0
        merged_attn_weights = torch.where(neighbor_attention_mask, neighbor_attn_weights, group_attn_weights)
        merged_attn_weights = merged_attn_weights.masked_fill(~causal, torch.finfo(merged_attn_weights.dtype).min)
        attn_weights = nn.functional.softmax(merged_attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).contiguous().reshape(bsz, q_len, self.hidden_size)
        return self.o_proj(attn_output), None, past_key_value


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_ids, past_key_value=None, use_cache=False):
        residual = hidden_states
        hidden_states, _, present = self.self_attn(
            self.input_layernorm(hidden_states), position_ids, past_key_value, use_cache
        )
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states)), present


class LlamaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        bsz, seq_length = input_ids.shape
        past_key_values_length = past_key_values[0][0].shape[2] if past_key_values is not None else 0
        position_ids = torch.arange(
            past_key_values_length, seq_length + past_key_values_length, dtype=torch.long, device=input_ids.device
        ).unsqueeze(0).view(-1, seq_length)
        hidden_states = self.embed_tokens(input_ids)
        next_decoder_cache = ()
        for idx, decoder_layer in enumerate(self.layers):
            past_key_value = past_key_values[idx] if past_key_values is not None else None
            hidden_states, present = decoder_layer(hidden_states, position_ids, past_key_value, use_cache)
            next_decoder_cache += (present,)
        return self.norm(hidden_states), (next_decoder_cache if use_cache else None)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        hidden, cache = self.model(input_ids, past_key_values=past_key_values, use_cache=use_cache)
        return SimpleNamespace(logits=self.lm_head(hidden), past_key_values=cache)


def make_model():
    torch.manual_seed(2413)
    config = SimpleNamespace(
        vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
        num_attention_heads=4, rms_norm_eps=1e-6, cache_rotated_keys=True,
    )
    model = LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(24131)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LlamaRMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

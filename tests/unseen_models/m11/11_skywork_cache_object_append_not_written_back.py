"""Skywork-13B (SkyworkAI remote code modeling_skywork.py), reduced, with a cache object.

SkyworkForCausalLM: model (SkyworkModel: embed_tokens, layers.N, norm) and lm_head; Llama-shaped decoder
layers (input_layernorm -> self_attn, post_attention_layernorm -> mlp), RMSNorm.  SkyworkAttention:
q/k/v/o_proj without bias, 6 heads of 16 (MHA), SkyworkRotaryEmbedding (rotate_half, base 1e4) with
cos/sin cached up to max_position_embeddings and sliced by `seq_len = kv_seq_len`, then gathered by
position_ids; matmul / sqrt(d), additive finfo.min causal mask, float32-or-wider softmax.
Cache: an HF-style cache object (SkyworkCache with update(k, v, layer_idx), get_seq_length()),
`out = model(ids, use_cache=True)`, `model(tok, past_key_values=out.past_key_values, use_cache=True)`.
Slip: SkyworkCache.update stores the prompt's keys/values when a layer's slot is empty, but on later calls
returns the concatenation without writing it back.  Step 0 still attends over prompt + itself (correct);
from step 1 on the cache lacks every decoded token, so the first divergence is step 1, layer 0.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["model.layers.0.self_attn", "model.layers.1.self_attn", "model.layers.2.self_attn"],
    "kind": "causal-multihead",
    "cache": "hf",
    "decode": {"mistake": "cache_stale", "step": 1, "layer": "model.layers.0.self_attn"},
    "style": "Skywork modeling_skywork.py: Llama-shaped, MHA 6x16, rotary cos/sin sliced by kv_seq_len and gathered by "
    "position_ids, SkyworkCache object; update() returns the concatenation without storing it",
}


class SkyworkCache:
    def __init__(self):
        self.key_cache = []
        self.value_cache = []
        self.seen_tokens = 0

    def get_seq_length(self, layer_idx=0):
        return self.seen_tokens

    def update(self, key_states, value_states, layer_idx):
        if layer_idx == 0:
            self.seen_tokens += key_states.shape[-2]
        if len(self.key_cache) <= layer_idx:
            self.key_cache.append(key_states)
            self.value_cache.append(value_states)
            return key_states, value_states
        return (torch.cat([self.key_cache[layer_idx], key_states], dim=-2),
                torch.cat([self.value_cache[layer_idx], value_states], dim=-2))


class SkyworkRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class SkyworkRotaryEmbedding(nn.Module):
    def __init__(self, dim, max_position_embeddings=128, base=10000.0):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        t = torch.arange(max_position_embeddings, dtype=torch.float64)
        emb = torch.cat((torch.outer(t, inv_freq),) * 2, dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def forward(self, x, seq_len):
        return self.cos_cached[:seq_len].to(x.dtype), self.sin_cached[:seq_len].to(x.dtype)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids):
    cos, sin = cos[position_ids].unsqueeze(1), sin[position_ids].unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class SkyworkAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.q_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=False)
        self.k_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=False)
        self.v_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=False)
        self.o_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=False)
        self.rotary_emb = SkyworkRotaryEmbedding(self.head_dim)

    def forward(self, hidden_states, attention_mask, position_ids, past_key_value=None):
        bsz, q_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        kv_seq_len = q_len + (past_key_value.get_seq_length() if past_key_value is not None else 0)
        cos, sin = self.rotary_emb(value_states, seq_len=kv_seq_len)
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin, position_ids)
        if past_key_value is not None:
            key_states, value_states = past_key_value.update(key_states, value_states, self.layer_idx)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(self.head_dim)
        attn_weights = attn_weights + attention_mask[..., : key_states.shape[-2]]
        soft_dtype = torch.promote_types(query_states.dtype, torch.float32)
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=soft_dtype).to(query_states.dtype)
        attn_output = torch.matmul(attn_weights, value_states).transpose(1, 2).reshape(bsz, q_len, self.hidden_size)
        return self.o_proj(attn_output)


class SkyworkMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SkyworkDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = SkyworkAttention(config, layer_idx)
        self.mlp = SkyworkMLP(config)
        self.input_layernorm = SkyworkRMSNorm(config.hidden_size)
        self.post_attention_layernorm = SkyworkRMSNorm(config.hidden_size)

    def forward(self, hidden_states, attention_mask, position_ids, past_key_value=None):
        hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states), attention_mask,
                                                       position_ids, past_key_value)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class SkyworkModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([SkyworkDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = SkyworkRMSNorm(config.hidden_size)

    def forward(self, input_ids, past_key_values=None):
        bsz, seq_length = input_ids.shape
        past_len = past_key_values.get_seq_length() if past_key_values is not None else 0
        position_ids = torch.arange(past_len, past_len + seq_length, device=input_ids.device)[None].expand(bsz, -1)
        hidden_states = self.embed_tokens(input_ids)
        kv_len = past_len + seq_length
        allowed = torch.arange(kv_len)[None, :] <= position_ids[0][:, None]
        mask = torch.zeros(seq_length, kv_len, dtype=hidden_states.dtype)
        mask = mask.masked_fill(~allowed, torch.finfo(hidden_states.dtype).min)[None, None]
        for layer in self.layers:
            hidden_states = layer(hidden_states, mask, position_ids, past_key_values)
        return self.norm(hidden_states)


class SkyworkForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = SkyworkModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        if use_cache and past_key_values is None:
            past_key_values = SkyworkCache()
        hidden = self.model(input_ids, past_key_values if use_cache else None)
        return SimpleNamespace(logits=self.lm_head(hidden), past_key_values=past_key_values if use_cache else None)


def make_model():
    torch.manual_seed(1111)
    config = SimpleNamespace(vocab_size=96, hidden_size=96, intermediate_size=192, num_hidden_layers=3,
                             num_attention_heads=6)
    model = SkyworkForCausalLM(config)
    g = torch.Generator().manual_seed(11111)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, SkyworkRMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

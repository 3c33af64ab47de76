"""Phi-3.5-MoE after transformers' modeling_phimoe.py (legacy `_prepare_4d_causal_attention_mask` era),
small config, eager attention.

PhimoeForCausalLM: model (PhimoeModel: embed_tokens, layers.N, norm) and lm_head *with bias*.
PhimoeDecoderLayer: input_layernorm (nn.LayerNorm with bias) -> self_attn -> + residual ->
post_attention_layernorm -> block_sparse_moe (gate Linear, experts.N with w1/w2/w3; top-2 routing
in its eval form) -> + residual.  PhimoeAttention: q_proj/k_proj/v_proj/o_proj all with bias
(attention_bias True), GQA 4/2 via repeat_kv, rotate_half rotary base 1e6, matmul / sqrt(hd),
additive finfo.min mask, softmax in float32.
Cache: hf, a DynamicCache-like `PhimoeCache` (update(k, v, layer_idx), get_seq_length()) created when
use_cache=True; `past_key_values_length` drives position_ids.
Slip (decode only): `_make_causal_mask(q_len, kv_len)` builds the mask as `torch.ones(q_len, kv_len).tril()`
from the top-left corner, with no `diagonal=kv_len - q_len` offset.  On the prompt (no past) that is
the right causal mask; on a one-token step the new token keeps only key 0 visible, hiding every
other cached key and itself.  Positions, keys and values are right.
"""

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
    "decode": {"mistake": "cache_mask", "step": 0, "layer": "model.layers.0.self_attn"},
    "style": "modeling_phimoe.py: LayerNorm with bias, q/k/v/o bias, lm_head bias, block_sparse_moe experts w1/w2/w3, "
    "GQA 4/2 repeat_kv, rotate_half base 1e6, PhimoeCache; slip: decode mask tril from the top-left (no past offset)",
}


class PhimoeCache:
    def __init__(self):
        self.key_cache, self.value_cache = [], []

    def get_seq_length(self, layer_idx=0):
        return 0 if len(self.key_cache) <= layer_idx else self.key_cache[layer_idx].shape[-2]

    def update(self, key_states, value_states, layer_idx):
        if len(self.key_cache) <= layer_idx:
            self.key_cache.append(key_states)
            self.value_cache.append(value_states)
        else:
            self.key_cache[layer_idx] = torch.cat([self.key_cache[layer_idx], key_states], dim=-2)
            self.value_cache[layer_idx] = torch.cat([self.value_cache[layer_idx], value_states], dim=-2)
        return self.key_cache[layer_idx], self.value_cache[layer_idx]


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def repeat_kv(hidden_states, n_rep):
    b, kvh, s, d = hidden_states.shape
    return hidden_states[:, :, None].expand(b, kvh, n_rep, s, d).reshape(b, kvh * n_rep, s, d)


class PhimoeRotaryEmbedding(nn.Module):
    def __init__(self, dim, base):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x, position_ids):
        freqs = position_ids[:, :, None].to(self.inv_freq.dtype) * self.inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class PhimoeAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(h, self.num_key_value_heads * self.head_dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(h, self.num_key_value_heads * self.head_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=config.attention_bias)
        self.rotary_emb = PhimoeRotaryEmbedding(self.head_dim, config.rope_theta)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None):
        bsz, q_len, _ = hidden_states.size()
        q = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary_emb(v, position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if past_key_value is not None:
            k, v = past_key_value.update(k, v, self.layer_idx)
        k = repeat_kv(k, self.num_key_value_groups)
        v = repeat_kv(v, self.num_key_value_groups)
        attn_weights = torch.matmul(q, k.transpose(2, 3)) / (self.head_dim**0.5)
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.promote_types(attn_weights.dtype, torch.float32)).to(q.dtype)
        attn_output = torch.matmul(attn_weights, v).transpose(1, 2).contiguous().reshape(bsz, q_len, -1)
        return self.o_proj(attn_output), attn_weights, past_key_value


class PhimoeBlockSparseTop2MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.w1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.w3 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)

    def forward(self, hidden_states):
        return self.w2(F.silu(self.w1(hidden_states)) * self.w3(hidden_states))


class PhimoeSparseMoeBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_experts = config.num_local_experts
        self.top_k = config.num_experts_per_tok
        self.gate = nn.Linear(config.hidden_size, self.num_experts, bias=False)
        self.experts = nn.ModuleList([PhimoeBlockSparseTop2MLP(config) for _ in range(self.num_experts)])

    def forward(self, hidden_states):
        b, s, d = hidden_states.shape
        flat = hidden_states.view(-1, d)
        router_logits = self.gate(flat)
        routing_weights, selected = torch.topk(router_logits, self.top_k, dim=-1)
        routing_weights = F.softmax(routing_weights, dim=-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            w = (routing_weights * (selected == e).to(routing_weights.dtype)).sum(-1, keepdim=True)
            out = out + w * expert(flat)
        return out.view(b, s, d)


class PhimoeDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = PhimoeAttention(config, layer_idx)
        self.block_sparse_moe = PhimoeSparseMoeBlock(config)
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.rms_norm_eps, elementwise_affine=True)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.rms_norm_eps, elementwise_affine=True)

    def forward(self, hidden_states, attention_mask, position_ids, past_key_value):
        residual = hidden_states
        hidden_states, _, _ = self.self_attn(self.input_layernorm(hidden_states), attention_mask, position_ids, past_key_value)
        hidden_states = residual + hidden_states
        return hidden_states + self.block_sparse_moe(self.post_attention_layernorm(hidden_states))


def _make_causal_mask(q_len, kv_len, dtype, device):
    visible = torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril()
    mask = torch.zeros(q_len, kv_len, dtype=dtype, device=device).masked_fill(~visible, torch.finfo(dtype).min)
    return mask[None, None]


class PhimoeModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([PhimoeDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.rms_norm_eps, elementwise_affine=True)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        batch_size, seq_length = input_ids.shape
        if use_cache and past_key_values is None:
            past_key_values = PhimoeCache()
        past_key_values_length = past_key_values.get_seq_length() if past_key_values is not None else 0
        position_ids = torch.arange(past_key_values_length, seq_length + past_key_values_length,
                                    dtype=torch.long, device=input_ids.device).unsqueeze(0)
        inputs_embeds = self.embed_tokens(input_ids)
        attention_mask = _make_causal_mask(seq_length, seq_length + past_key_values_length, inputs_embeds.dtype,
                                           input_ids.device)
        hidden_states = inputs_embeds
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(hidden_states, attention_mask, position_ids, past_key_values)
        return self.norm(hidden_states), past_key_values


class PhimoeForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = PhimoeModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=config.lm_head_bias)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        hidden, past = self.model(input_ids, past_key_values=past_key_values, use_cache=use_cache)
        return SimpleNamespace(logits=self.lm_head(hidden), past_key_values=past if use_cache else None)


def make_model():
    torch.manual_seed(0)
    config = SimpleNamespace(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=1e6,
                             attention_bias=True, lm_head_bias=True, num_local_experts=4, num_experts_per_tok=2)
    model = PhimoeForCausalLM(config)
    for m in model.modules():
        if isinstance(m, nn.LayerNorm):
            nn.init.uniform_(m.weight, 0.6, 1.4)
            nn.init.uniform_(m.bias, -0.1, 0.1)
    return model.eval()

"""Baichuan2-7B (modeling_baichuan.py of baichuan-inc/Baichuan2-7B-Base) ported to a transformers
Cache-like object (small, random weights).

BaichuanForCausalLM: model (BaichuanModel: embed_tokens, layers.N, norm) and lm_head
(NormHead: rows L2-normalised before the product).  DecoderLayer: input_layernorm -> self_attn,
post_attention_layernorm -> mlp (gate/down/up, SiLU).  Attention: fused `W_pack` (q, k, v rows, no
bias) unflattened to (3, hidden), o_proj, MHA 4 heads, RotaryEmbedding with inv_freq and
cos_cached/sin_cached tables (halves, rotate_half) base 1e4, explicit matmul / sqrt(head_dim), the
causal mask built inside the attention from the key length (query i sees keys <= i + past).
Cache: hf, a `BaichuanCache` object (`update(k, v, layer_idx)`, `get_seq_length()`, counts
`seen_tokens`), created when `use_cache=True`; `out = model(ids, use_cache=True)`,
`model(tok, past_key_values=out.past_key_values, use_cache=True)`; logits in `out.logits`.
Slip: `BaichuanCache.update` stores the prompt, but on later calls returns the concatenation
without writing it back (the assignment was turned into a local variable), so the cache stays at the
prompt forever.  Step 0 is right (its own key is in the returned tensors); from step 1 on each token
misses every earlier decoded token.  Positions come from `seen_tokens`, which does count, so
rotary positions stay right.
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
        "mistake": "cache_stale",
        "step": 1,
        "layer": "model.layers.0.self_attn",
    },
    "style": "Baichuan2-7B: W_pack fused qkv unflatten, cos_cached/sin_cached rotate_half, NormHead, BaichuanCache "
    "with seen_tokens; update() returns the concatenation without storing it (cache frozen at the prompt)",
}


class BaichuanCache:
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
        key_cache = torch.cat([self.key_cache[layer_idx], key_states], dim=-2)
        value_cache = torch.cat([self.value_cache[layer_idx], value_states], dim=-2)
        return key_cache, value_cache


class RMSNorm(nn.Module):
    def __init__(self, hidden_size, epsilon=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.epsilon = epsilon

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.epsilon))


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, max_position_embeddings=128, base=10000):
        super().__init__()
        self.inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        t = torch.arange(max_position_embeddings, dtype=torch.float64)
        freqs = torch.einsum("i,j->ij", t, self.inv_freq.to(torch.float64))
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos()[None, None, :, :].float(), persistent=False)
        self.register_buffer("sin_cached", emb.sin()[None, None, :, :].float(), persistent=False)

    def forward(self, x, seq_len):
        return self.cos_cached[:, :, :seq_len, ...].to(x.dtype), self.sin_cached[:, :, :seq_len, ...].to(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos_, sin_, position_ids):
    cos = cos_.squeeze(1).squeeze(0)[position_ids].unsqueeze(1)
    sin = sin_.squeeze(1).squeeze(0)[position_ids].unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class Attention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.W_pack = nn.Linear(self.hidden_size, 3 * self.hidden_size, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=False)
        self.rotary_emb = RotaryEmbedding(self.head_dim, max_position_embeddings=config.max_position_embeddings)

    def forward(self, hidden_states, position_ids, past_key_value=None):
        bsz, q_len, _ = hidden_states.size()
        proj = self.W_pack(hidden_states)
        proj = proj.unflatten(-1, (3, self.hidden_size)).unsqueeze(0).transpose(0, -2).squeeze(-2)
        query_states = proj[0].view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = proj[1].view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        value_states = proj[2].view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary_emb(value_states, seq_len=int(position_ids.max()) + 1)
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin, position_ids)
        if past_key_value is not None:
            key_states, value_states = past_key_value.update(key_states, value_states, self.layer_idx)
        kv_len = key_states.shape[-2]
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(self.head_dim)
        allowed = torch.ones(q_len, kv_len, dtype=torch.bool, device=hidden_states.device).tril(kv_len - q_len)
        attn_weights = attn_weights.masked_fill(~allowed, torch.finfo(attn_weights.dtype).min)
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, value_states).transpose(1, 2).reshape(bsz, q_len, self.hidden_size)
        return self.o_proj(attn_output), None, past_key_value


class MLP(nn.Module):
    def __init__(self, hidden_size, intermediate_size):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, epsilon=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, epsilon=config.rms_norm_eps)

    def forward(self, hidden_states, position_ids, past_key_value=None):
        residual = hidden_states
        hidden_states, _, _ = self.self_attn(
            hidden_states=self.input_layernorm(hidden_states), position_ids=position_ids,
            past_key_value=past_key_value)
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class BaichuanModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, epsilon=config.rms_norm_eps)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        if use_cache and past_key_values is None:
            past_key_values = BaichuanCache()
        past_len = past_key_values.get_seq_length() if past_key_values is not None else 0
        seq_length = input_ids.shape[1]
        position_ids = torch.arange(past_len, past_len + seq_length, device=input_ids.device)
        position_ids = position_ids.unsqueeze(0).expand(input_ids.shape[0], -1)
        hidden_states = self.embed_tokens(input_ids)
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(hidden_states, position_ids, past_key_values)
        return self.norm(hidden_states), past_key_values


class NormHead(nn.Module):
    def __init__(self, hidden_size, vocab_size):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab_size, hidden_size) * 0.1)

    def forward(self, hidden_states):
        return F.linear(hidden_states, F.normalize(self.weight))


class BaichuanForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = BaichuanModel(config)
        self.lm_head = NormHead(config.hidden_size, config.vocab_size)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        h, cache = self.model(input_ids, past_key_values=past_key_values, use_cache=use_cache)
        return SimpleNamespace(logits=self.lm_head(h) * 4.0, past_key_values=cache if use_cache else None)


def make_model():
    torch.manual_seed(911)
    config = SimpleNamespace(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                             num_attention_heads=4, max_position_embeddings=128, rms_norm_eps=1e-6)
    model = BaichuanForCausalLM(config)
    g = torch.Generator().manual_seed(9111)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

"""Snowflake Arctic (remote modeling_arctic.py), small config with random weights.

ArcticForCausalLM: model (embed_tokens, layers.N, norm) and lm_head.  ArcticDecoderLayer is Arctic's
dense-MoE hybrid: input_layernorm -> self_attn -> residual, then a `residual_mlp` (dense SwiGLU behind
`residual_layernorm`) added in parallel with the sparse `block_sparse_moe` (4 experts, top-2, behind
post_attention_layernorm).  ArcticAttention is Mixtral's: q/k/v/o without bias, GQA 4/2 `repeat_kv`,
rotate_half rotary (base 1e4) from an `ArcticRotaryEmbedding` with cos_cached/sin_cached indexed by
position_ids, eager matmul / sqrt(d) + finfo.min mask.
Cache: hf: `out = model(ids, use_cache=True)`, `model(tok, past_key_values=out.past_key_values,
use_cache=True)`; the cache is an `ArcticCache` object ((b, kv, s, d) per layer, cat on dim 2).
Slip (decode only): `ArcticModel.forward` builds the default `position_ids = arange(seq_length)`
before reading `past_key_values_length`, and only the mask uses the past length; so a decoded token
is rotated as position 0.  The full forward and the prompt pass are exact.
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
    "decode": {"mistake": "cache_positions", "step": 0, "layer": "model.layers.0.self_attn"},
    "style": "modeling_arctic.py: residual_mlp in parallel with top-2 MoE, Mixtral attention GQA 4/2, "
    "cos_cached/sin_cached rotary, ArcticCache object; position_ids = arange(seq_length) ignores the past",
}


class ArcticCache:
    def __init__(self):
        self.key_cache, self.value_cache = [], []

    def get_seq_length(self, layer_idx=0):
        return self.key_cache[layer_idx].shape[-2] if len(self.key_cache) > layer_idx else 0

    def update(self, key_states, value_states, layer_idx):
        if len(self.key_cache) <= layer_idx:
            self.key_cache.append(key_states)
            self.value_cache.append(value_states)
        else:
            self.key_cache[layer_idx] = torch.cat([self.key_cache[layer_idx], key_states], dim=-2)
            self.value_cache[layer_idx] = torch.cat([self.value_cache[layer_idx], value_states], dim=-2)
        return self.key_cache[layer_idx], self.value_cache[layer_idx]


class ArcticRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


class ArcticRotaryEmbedding(nn.Module):
    def __init__(self, dim, max_position_embeddings=128, base=10000.0):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        freqs = torch.outer(torch.arange(max_position_embeddings, dtype=torch.float64), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def forward(self, x, position_ids):
        return self.cos_cached[position_ids].to(x.dtype), self.sin_cached[position_ids].to(x.dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def repeat_kv(hidden_states, n_rep):
    b, kv, s, d = hidden_states.shape
    return hidden_states[:, :, None].expand(b, kv, n_rep, s, d).reshape(b, kv * n_rep, s, d)


class ArcticAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.rotary_emb = ArcticRotaryEmbedding(self.head_dim, base=config.rope_theta)

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
        w = torch.matmul(q, k.transpose(2, 3)) / self.head_dim ** 0.5 + attention_mask
        w = F.softmax(w, dim=-1)
        o = torch.matmul(w, v).transpose(1, 2).reshape(bsz, q_len, -1)
        return self.o_proj(o), None, past_key_value


class ArcticMLP(nn.Module):
    def __init__(self, d, ffn):
        super().__init__()
        self.w1 = nn.Linear(d, ffn, bias=False)
        self.w2 = nn.Linear(ffn, d, bias=False)
        self.w3 = nn.Linear(d, ffn, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class ArcticMoE(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.top_k = 2
        self.gate = nn.Linear(config.hidden_size, config.num_local_experts, bias=False)
        self.experts = nn.ModuleList([ArcticMLP(config.hidden_size, config.intermediate_size)
                                      for _ in range(config.num_local_experts)])

    def forward(self, x):
        w, idx = F.softmax(self.gate(x), dim=-1).topk(self.top_k, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e, ex in enumerate(self.experts):
            out = out + ((idx == e).to(x.dtype) * w).sum(-1, keepdim=True) * ex(x)
        return out


class ArcticDecoderLayer(nn.Module):
    def __init__(self, config, i):
        super().__init__()
        self.self_attn = ArcticAttention(config, i)
        self.input_layernorm = ArcticRMSNorm(config.hidden_size)
        self.post_attention_layernorm = ArcticRMSNorm(config.hidden_size)
        self.residual_layernorm = ArcticRMSNorm(config.hidden_size)
        self.residual_mlp = ArcticMLP(config.hidden_size, config.hidden_size)
        self.block_sparse_moe = ArcticMoE(config)

    def forward(self, hidden_states, attention_mask, position_ids, past_key_value):
        residual = hidden_states
        h, _, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), attention_mask=attention_mask,
                                 position_ids=position_ids, past_key_value=past_key_value)
        h = residual + h
        residual_input = h
        residual_mlp = self.residual_mlp(self.residual_layernorm(h))
        moe = self.block_sparse_moe(self.post_attention_layernorm(h))
        return residual_input + residual_mlp + moe


class ArcticModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([ArcticDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = ArcticRMSNorm(config.hidden_size)

    def forward(self, input_ids, past_key_values=None, position_ids=None):
        batch_size, seq_length = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(seq_length, dtype=torch.long).unsqueeze(0).expand(batch_size, -1)
        past_key_values_length = past_key_values.get_seq_length() if past_key_values is not None else 0
        h = self.embed_tokens(input_ids)
        total = past_key_values_length + seq_length
        q_pos = torch.arange(past_key_values_length, total)
        mask = torch.zeros(seq_length, total, dtype=h.dtype)
        mask = mask.masked_fill(torch.arange(total)[None, :] > q_pos[:, None], torch.finfo(h.dtype).min)[None, None]
        for layer in self.layers:
            h = layer(h, mask, position_ids, past_key_values)
        return self.norm(h)


class ArcticForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = ArcticModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        if use_cache and past_key_values is None:
            past_key_values = ArcticCache()
        h = self.model(input_ids, past_key_values=past_key_values)
        return SimpleNamespace(logits=self.lm_head(h), past_key_values=past_key_values if use_cache else None)


def make_model():
    torch.manual_seed(1210)
    config = SimpleNamespace(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, rope_theta=10000.0)
    model = ArcticForCausalLM(config)
    g = torch.Generator().manual_seed(12101)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, ArcticRMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

"""A Llama-architecture model run the way unsloth runs it (unsloth/models/llama.py), in plain torch.

HF Llama tree (model.embed_tokens, model.layers.N.{input_layernorm, self_attn, post_attention_layernorm,
mlp}, model.norm, lm_head), q/k/v/o without bias, GQA 4/2, rotate_half rotary (base 1e4) whose cos/sin
are cached in float64 and cast at use (`rotary_emb.get_cached`).  Prompt and full passes take unsloth's
`LlamaAttention_fast_forward` path: rotate, concatenate the legacy past tuple (b, kv, s, d) on dim 2,
repeat_kv (h // 2), eager softmax(q k^T / sqrt(d)) with a causal mask, o_proj; present = (k, v).
One-token steps with a past take `LlamaAttention_fast_forward_inference`: the past tuple is copied once into
a preallocated `paged_attention` buffer (S, 2, b, kv, d) (`paged_attention_K` / `paged_attention_V`
views), the new key/value are written at slot `seq_len`, and attention runs over the first
`kv_seq_len = seq_len + 1` slots with no mask; the returned present is a view of those slots.
Positions come from `past_key_values[0][0].shape[-2]`.
Cache: hf tuples: `out = model(ids, use_cache=True)`, `model(tok, past_key_values=out.past_key_values,
use_cache=True)`; logits in `out.logits`.
Slip: after writing the new key/value into the buffer, the inference path also concatenates them
(`torch.cat([Kn_cached, Kn], dim=2)`, a leftover of the path that has no buffer): the new token's key and
value are in the cache twice from step 0 on (updated twice).
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
    "decode": {"mistake": "cache_stale", "step": 0, "layer": "model.layers.0.self_attn"},
    "style": "unsloth fast Llama: HF names, GQA 4/2, rotate_half base 1e4, legacy tuples for prefill, paged_attention "
    "buffer for one-token steps; slip: the new key/value are written into the buffer and concatenated again",
}

KV_CACHE_INCREMENT = 16


class LlamaRotaryEmbedding(nn.Module):
    def __init__(self, dim, max_position_embeddings=128, base=10000.0):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        t = torch.arange(max_position_embeddings, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos_cached = emb.cos()
        self.sin_cached = emb.sin()

    def get_cached(self, seq_len):
        return self.cos_cached[:seq_len], self.sin_cached[:seq_len]


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(q, k, cos, sin, position_ids):
    cos = cos[position_ids].unsqueeze(1).to(q.dtype)
    sin = sin[position_ids].unsqueeze(1).to(q.dtype)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def repeat_kv(x, n_rep):
    b, kv, s, d = x.shape
    if n_rep == 1:
        return x
    return x[:, :, None].expand(b, kv, n_rep, s, d).reshape(b, kv * n_rep, s, d)


class LlamaAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(self.head_dim, config.max_position_embeddings)

    def forward(self, hidden_states, position_ids, past_key_value=None, use_cache=False):
        bsz, q_len, _ = hidden_states.shape
        if past_key_value is not None and q_len == 1:
            return self.fast_forward_inference(hidden_states, position_ids, past_key_value)
        Q = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        K = self.k_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        V = self.v_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        kv_seq_len = q_len + (past_key_value[0].shape[-2] if past_key_value is not None else 0)
        cos, sin = self.rotary_emb.get_cached(kv_seq_len)
        Q, K = apply_rope(Q, K, cos, sin, position_ids)
        if past_key_value is not None:
            K = torch.cat([past_key_value[0], K], dim=2)
            V = torch.cat([past_key_value[1], V], dim=2)
        past_key_value = (K, V) if use_cache else None
        Kr = repeat_kv(K, self.num_key_value_groups)
        Vr = repeat_kv(V, self.num_key_value_groups)
        scores = torch.matmul(Q, Kr.transpose(2, 3)) / math.sqrt(self.head_dim)
        past = kv_seq_len - q_len
        causal = torch.ones(q_len, kv_seq_len, dtype=torch.bool, device=Q.device).triu(past + 1)
        scores = scores.masked_fill(causal, torch.finfo(scores.dtype).min)
        A = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(Q.dtype)
        A = torch.matmul(A, Vr).transpose(1, 2).reshape(bsz, q_len, self.num_heads * self.head_dim)
        return self.o_proj(A), past_key_value

    def fast_forward_inference(self, hidden_states, position_ids, past_key_value):
        Xn = hidden_states
        bsz, _, hd = Xn.shape
        K1, V1 = past_key_value
        seq_len = K1.shape[-2]
        kv_seq_len = seq_len + 1
        n_kv, d = self.num_key_value_heads, self.head_dim
        Qn = self.q_proj(Xn).view(bsz, 1, self.num_heads, d).transpose(1, 2)
        Kn = self.k_proj(Xn).view(bsz, 1, n_kv, d).transpose(1, 2)
        Vn = self.v_proj(Xn).view(bsz, 1, n_kv, d).transpose(1, 2)
        cos, sin = self.rotary_emb.get_cached(kv_seq_len)
        Qn, Kn = apply_rope(Qn, Kn, cos, sin, position_ids)
        # fresh paged buffer holding the past, then the new slot
        self.paged_attention = torch.empty(
            (KV_CACHE_INCREMENT + kv_seq_len, 2, bsz, n_kv, d), dtype=Xn.dtype, device=Xn.device
        )
        self.paged_attention_K = self.paged_attention[:, 0]
        self.paged_attention_V = self.paged_attention[:, 1]
        self.paged_attention_K[:seq_len] = K1.permute(2, 0, 1, 3)
        self.paged_attention_V[:seq_len] = V1.permute(2, 0, 1, 3)
        self.paged_attention_K[seq_len] = Kn.permute(2, 0, 1, 3)[0]
        self.paged_attention_V[seq_len] = Vn.permute(2, 0, 1, 3)[0]
        Kn_cached = self.paged_attention_K[:kv_seq_len].permute(1, 2, 0, 3)
        Vn_cached = self.paged_attention_V[:kv_seq_len].permute(1, 2, 0, 3)
        Kn = torch.cat([Kn_cached, Kn], dim=2)
        Vn = torch.cat([Vn_cached, Vn], dim=2)
        Knn = repeat_kv(Kn, self.num_key_value_groups)
        Vnn = repeat_kv(Vn, self.num_key_value_groups)
        A = torch.matmul(Qn, Knn.transpose(2, 3)) * (1.0 / math.sqrt(d))
        A = torch.softmax(A, dim=-1, dtype=torch.promote_types(A.dtype, torch.float32)).to(A.dtype)
        A = torch.matmul(A, Vnn).transpose(1, 2).reshape(bsz, 1, hd)
        return self.o_proj(A), (Kn, Vn)


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.variance_epsilon))


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = LlamaAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size)

    def forward(self, hidden_states, position_ids, past_key_value=None, use_cache=False):
        attn, present = self.self_attn(self.input_layernorm(hidden_states), position_ids, past_key_value, use_cache)
        hidden_states = hidden_states + attn
        hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states, present


class LlamaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = LlamaRMSNorm(config.hidden_size)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        bsz, seq_length = input_ids.shape
        past_len = past_key_values[0][0].shape[-2] if past_key_values is not None else 0
        position_ids = torch.arange(past_len, past_len + seq_length, device=input_ids.device)[None].expand(bsz, -1)
        hidden_states = self.embed_tokens(input_ids)
        next_cache = () if use_cache else None
        for idx, layer in enumerate(self.layers):
            past = past_key_values[idx] if past_key_values is not None else None
            hidden_states, present = layer(hidden_states, position_ids, past, use_cache)
            if use_cache:
                next_cache += (present,)
        return self.norm(hidden_states), next_cache


class LlamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        hidden, cache = self.model(input_ids, past_key_values, use_cache or past_key_values is not None)
        return SimpleNamespace(logits=self.lm_head(hidden), past_key_values=cache)


def make_model():
    torch.manual_seed(1511)
    config = SimpleNamespace(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128,
    )
    model = LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(15111)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LlamaRMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

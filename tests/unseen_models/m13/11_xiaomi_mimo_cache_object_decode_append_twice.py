"""Xiaomi MiMo remote code (modeling_mimo.py: a Qwen2 derivative with multi-token-prediction layers),
reduced: the MTP layers are not built.

MiMoForCausalLM: model (MiMoModel: embed_tokens, layers.N = MiMoDecoderLayer, norm) and lm_head.
MiMoAttention: q/k/v with bias, o_proj without, GQA 4/2 (repeat_kv), rotate_half rotary base 64e4 with
the cos/sin cache precomputed in float64 and indexed by position_ids, eager attention with a finfo.min
mask from cache_position.
Cache: hf with a cache object (`MiMoCache`: update(k, v, layer_idx) -> full k, v; get_seq_length()).
`out = model(ids, use_cache=True)`, `model(tok, past_key_values=out.past_key_values, use_cache=True)`;
logits in `out.logits`.
Slip: the single-token branch (`q_len == 1`, written for the MTP draft step, which keeps its own
cache) calls `past_key_value.update(...)` to "stage" the new key/value and then the shared code path
updates again, so from decode step 0 on every decoded token is stored twice.  Full forward and prompt
pass are exact.
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
    "decode": {"mistake": "cache_stale", "step": 0, "layer": "model.layers.0.self_attn"},
    "style": "MiMo modeling_mimo.py (Qwen2 family): qkv bias, GQA 4/2, float64 cos/sin cache indexed by position_ids, "
    "MiMoCache object; the q_len == 1 branch stages the new k/v with update() and then updates again",
}


class MiMoCache:
    def __init__(self):
        self.layers = {}

    def get_seq_length(self, layer_idx=0):
        return self.layers[layer_idx][0].shape[2] if layer_idx in self.layers else 0

    def update(self, k, v, layer_idx):
        if layer_idx in self.layers:
            pk, pv = self.layers[layer_idx]
            k, v = torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2)
        self.layers[layer_idx] = (k, v)
        return k, v


class MiMoRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class MiMoRotaryEmbedding(nn.Module):
    def __init__(self, dim, max_position_embeddings=64, base=640000.0):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        t = torch.arange(max_position_embeddings, dtype=torch.float64)
        emb = torch.cat([torch.outer(t, inv_freq)] * 2, dim=-1)
        self.cos_cached, self.sin_cached = emb.cos(), emb.sin()

    def forward(self, x, position_ids):
        return self.cos_cached[position_ids].to(x.dtype), self.sin_cached[position_ids].to(x.dtype)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def repeat_kv(x, n_rep):
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


class MiMoAttention(nn.Module):
    def __init__(self, layer_idx, hidden=64, heads=4, kv_heads=2):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_key_value_heads = heads, kv_heads
        self.head_dim = hidden // heads
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=True)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=True)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=False)
        self.rotary_emb = MiMoRotaryEmbedding(self.head_dim)

    def forward(self, hidden_states, attention_mask, position_ids, past_key_value=None):
        bsz, q_len, _ = hidden_states.size()
        q = self.q_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary_emb(v, position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if past_key_value is not None:
            if q_len == 1:
                past_key_value.update(k, v, self.layer_idx)  # staged for the draft step
            k, v = past_key_value.update(k, v, self.layer_idx)
        n_rep = self.num_heads // self.num_key_value_heads
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        w = torch.matmul(q, k.transpose(2, 3)) * self.head_dim ** -0.5
        if attention_mask is not None:
            w = w + attention_mask
        w = F.softmax(w, dim=-1)
        out = torch.matmul(w, v).transpose(1, 2).reshape(bsz, q_len, -1)
        return self.o_proj(out)


class MiMoMLP(nn.Module):
    def __init__(self, hidden=64, inter=160):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MiMoDecoderLayer(nn.Module):
    def __init__(self, layer_idx):
        super().__init__()
        self.self_attn = MiMoAttention(layer_idx)
        self.mlp = MiMoMLP()
        self.input_layernorm = MiMoRMSNorm(64)
        self.post_attention_layernorm = MiMoRMSNorm(64)

    def forward(self, h, attention_mask, position_ids, past_key_value=None):
        h = h + self.self_attn(self.input_layernorm(h), attention_mask, position_ids, past_key_value)
        return h + self.mlp(self.post_attention_layernorm(h))


class MiMoModel(nn.Module):
    def __init__(self, vocab=96):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, 64)
        self.layers = nn.ModuleList([MiMoDecoderLayer(i) for i in range(3)])
        self.norm = MiMoRMSNorm(64)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        if use_cache and past_key_values is None:
            past_key_values = MiMoCache()
        past_seen = past_key_values.get_seq_length() if past_key_values is not None else 0
        T = input_ids.shape[1]
        cache_position = torch.arange(past_seen, past_seen + T, device=input_ids.device)
        position_ids = cache_position.unsqueeze(0)
        h = self.embed_tokens(input_ids)
        mask = None
        if T > 1:  # a single new token may see every cached key: no mask is built
            kv = torch.arange(past_seen + T, device=input_ids.device)
            mask = torch.zeros(T, past_seen + T, dtype=h.dtype, device=h.device)
            mask = mask.masked_fill(kv[None] > cache_position[:, None], torch.finfo(h.dtype).min)[None, None]
        for layer in self.layers:
            h = layer(h, mask, position_ids, past_key_values)
        return self.norm(h), past_key_values


class MiMoForCausalLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = MiMoModel()
        self.lm_head = nn.Linear(64, 96, bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        h, cache = self.model(input_ids, past_key_values, use_cache)
        return SimpleNamespace(logits=self.lm_head(h), past_key_values=cache if use_cache else None)


def make_model():
    torch.manual_seed(1311)
    model = MiMoForCausalLM()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, MiMoRMSNorm):
                m.weight.copy_(1.0 + 0.2 * torch.randn_like(m.weight))
    return model.eval()

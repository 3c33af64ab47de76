"""microsoft/onnxruntime-genai model builder (src/python/py/models/builder.py) for a Qwen3-style model:
the ONNX graph it emits, written back out as torch modules, with the contrib `GroupQueryAttention`
operator (GQA) implemented in torch.

Builder node names become the module tree: `model.embed_tokens`, `model.layers.N` with
`input_layernorm` (SimplifiedLayerNormalization = RMSNorm), `attn` (`q_proj`/`k_proj`/`v_proj`/
`o_proj` MatMuls, the per-head `q_norm`/`k_norm` RMSNorms Qwen3 adds before the rotary),
`post_attention_layernorm`, `mlp` (gate/up/down), `model.norm`, `lm_head`.  The builder's
`cos_cache`/`sin_cache` tables are (max_len, head_dim / 2) and the rotary is the non-interleaved
(rotate-half) form, theta 1e6.  GQA op semantics: q/k/v come in BSNH (b, s, heads, d), past/present
key/value are BNSH (b, kv_heads, s, d), kv head h // 2 for query head h (GQA 4/2), scale 1/sqrt(d),
causal with the past offset.
Cache: hf: `out = model(ids, use_cache=True)`, then
`model(tok, past_key_values=out.past_key_values, use_cache=True)`; `past_key_values` is a tuple of
per-layer (present_key, present_value) in BNSH.
Slip: in the decode branch (past given) the new key/value are concatenated to the past still in the
op's BSNH input layout: `torch.cat([past_key, key], dim=2)` with past (b, 2, P, d) and key
(b, 1, 2, d) raises a size-mismatch RuntimeError on the first decoded token (in layer 0).  The prompt
branch transposes to BNSH before building the present, so the full forward and the prompt pass are
exact.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["model.layers.0.attn", "model.layers.1.attn"],
    "kind": "causal-multihead",
    "cache": "hf",
    "decode": {
        "mistake": "cache_other",
        "step": 0,
        "layer": "model.layers.0.attn",
    },
    "style": "onnxruntime-genai builder Qwen3 graph: q/k/v/o_proj, per-head q_norm/k_norm before rotary, "
    "cos_cache/sin_cache (max, d/2) rotate-half theta 1e6, GroupQueryAttention op (BSNH inputs, BNSH "
    "past/present, GQA 4/2); the decode branch concatenates BSNH keys to the BNSH past and raises",
}


class SimplifiedLayerNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def make_cos_sin_cache(head_dim, max_len, theta):
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    t = torch.arange(max_len, dtype=torch.float64)
    freqs = torch.outer(t, inv_freq)
    return freqs.cos(), freqs.sin()  # (max_len, head_dim / 2), float64


def rotary_embedding(x, cos_cache, sin_cache, position_ids):
    # x: (b, s, n, d), non-interleaved
    cos = cos_cache[position_ids].to(x.dtype)[:, :, None, :]
    sin = sin_cache[position_ids].to(x.dtype)[:, :, None, :]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def group_query_attention(query, key, value, past_key, past_value, num_heads, kv_num_heads, scale):
    """com.microsoft GroupQueryAttention: query/key/value BSNH, past/present BNSH."""
    b, s, _, d = query.shape
    if past_key is None:
        present_key = key.transpose(1, 2)
        present_value = value.transpose(1, 2)
        past_len = 0
    else:
        past_len = past_key.shape[2]
        present_key = torch.cat([past_key, key], dim=2)
        present_value = torch.cat([past_value, value], dim=2)
    total = present_key.shape[2]
    groups = num_heads // kv_num_heads
    k = present_key.repeat_interleave(groups, dim=1)
    v = present_value.repeat_interleave(groups, dim=1)
    q = query.transpose(1, 2)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    mask = torch.ones(s, total, dtype=torch.bool, device=q.device).tril(diagonal=past_len)
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = F.softmax(scores, dim=-1)
    out = torch.matmul(probs, v).transpose(1, 2).reshape(b, s, num_heads * d)
    return out, present_key, present_value


class BuilderAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.kv_num_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.kv_num_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.kv_num_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.q_norm = SimplifiedLayerNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = SimplifiedLayerNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x, cos_cache, sin_cache, position_ids, past=None):
        b, s, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, s, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(b, s, self.kv_num_heads, self.head_dim))
        v = self.v_proj(x).view(b, s, self.kv_num_heads, self.head_dim)
        q = rotary_embedding(q, cos_cache, sin_cache, position_ids)
        k = rotary_embedding(k, cos_cache, sin_cache, position_ids)
        past_key, past_value = past if past is not None else (None, None)
        out, present_key, present_value = group_query_attention(
            q, k, v, past_key, past_value, self.num_heads, self.kv_num_heads, 1.0 / math.sqrt(self.head_dim)
        )
        return self.o_proj(out), (present_key, present_value)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.input_layernorm = SimplifiedLayerNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = BuilderAttention(config)
        self.post_attention_layernorm = SimplifiedLayerNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos_cache, sin_cache, position_ids, past=None):
        a, present = self.attn(self.input_layernorm(x), cos_cache, sin_cache, position_ids, past)
        h = x + a
        return h + self.mlp(self.post_attention_layernorm(h)), present


class Decoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([Layer(config) for _ in range(config.num_hidden_layers)])
        self.norm = SimplifiedLayerNorm(config.hidden_size, config.rms_norm_eps)


class BuilderQwen3ForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = Decoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.cos_cache, self.sin_cache = make_cos_sin_cache(config.head_dim, config.max_length, config.rope_theta)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        b, s = input_ids.shape
        past_len = past_key_values[0][0].shape[2] if past_key_values is not None else 0
        position_ids = torch.arange(past_len, past_len + s, device=input_ids.device)[None].expand(b, -1)
        h = self.model.embed_tokens(input_ids)
        presents = ()
        for i, layer in enumerate(self.model.layers):
            past = past_key_values[i] if past_key_values is not None else None
            h, present = layer(h, self.cos_cache, self.sin_cache, position_ids, past)
            presents += (present,)
        logits = self.lm_head(self.model.norm(h))
        return SimpleNamespace(logits=logits, past_key_values=presents if use_cache else None)


def make_model():
    torch.manual_seed(2213)
    config = SimpleNamespace(
        vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rope_theta=1000000.0, rms_norm_eps=1e-6, max_length=64,
    )
    model = BuilderQwen3ForCausalLM(config)
    g = torch.Generator().manual_seed(22131)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, SimplifiedLayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

"""google-deepmind/gemma's Flax Transformer (gemma/transformer.py, modules.py, layers.py, positional_
embeddings.py) ported to torch module by module, keeping the Flax names and einsum kernels.

Transformer: embedder (Embedder: input_embedding (vocab, d); encode = x * sqrt(d), decode = x @ E^T),
layer_0 .. layer_2 attributes (Block: pre_attention_norm, attn, pre_ffw_norm, mlp), final_norm.
RMSNorm scales by (1 + scale).  Attention: q_einsum kernel w (heads, d, hd), kv_einsum kernel w
(2, kv_heads, d, hd), attn_vec_einsum kernel w (heads, hd, d); GQA 4/2 by viewing the queries as
(B, T, K, G, H) (query head h = k * G + g reads kv head h // G); `apply_rope` on halves (first_half /
second_half) with max_wavelength 1e4; queries times query_pre_attn_scalar = hd**-0.5; masked logits
filled with K_MASK = -2.3819763e38; FeedForward: gating_einsum (2, d, hidden) gelu-gated, linear.
Cache: book-cache: `cache = mod.KVCache(n_layers=3)`, `model.reset_kv_cache()`, then
`model(prompt, cache=cache)`, `model(tok, cache=cache)`.  KVCache.layers["layer_i"] is the Flax cache
dict {'k', 'v', 'end_index'} with (B, 64, kv_heads, hd) slots (allocated on first use); positions come
from model.current_pos.  Attention writes the new k/v into a *copy* of its slots (as
`jax.lax.dynamic_update_slice` would) and returns (new_cache, out).
Slip (decode only): Transformer.forward writes the returned per-layer caches back into `cache.layers`
on the prefill call only (the first call after a reset); later (`_sample_step`) calls keep them in a local dict that is
dropped.  Step 0 attends correctly (its own k/v are in the local copy), but from step 1 on the slot of
every decoded token is still zeros and visible, so step 1 is the first that diverges.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["layer_0.attn", "layer_1.attn", "layer_2.attn"],
    "kind": "causal-multihead",
    "cache": "book-cache",
    "decode": {"mistake": "cache_stale", "step": 1, "layer": "layer_0.attn"},
    "style": "deepmind gemma Flax port: embedder/layer_i/final_norm, Einsum kernels q_einsum (h, d, hd), kv_einsum "
    "(2, kv, d, hd), attn_vec_einsum, (B,T,K,G,H) GQA 4/2, halves apply_rope, K_MASK fill, cache dicts "
    "{'k','v','end_index'}; slip: decode-step caches never written back",
}

K_MASK = -2.3819763e38
CACHE_SIZE = 64


class KVCache:
    def __init__(self, n_layers):
        self.n_layers = n_layers
        self.layers = {}

    def reset(self):
        self.layers = {}


class Einsum(nn.Module):
    def __init__(self, shape, scale):
        super().__init__()
        self.w = nn.Parameter(torch.randn(*shape) * scale)

    def forward(self, eqn, x):
        return torch.einsum(eqn, x, self.w)


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.scale = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        var = torch.mean(torch.square(x), dim=-1, keepdim=True)
        normed = x * torch.rsqrt(var + 1e-6)
        return normed * (1 + self.scale)


def apply_rope(inputs, positions, head_dim, max_wavelength=10000):
    # inputs (B, T, N, H); positions (B, T)
    fraction = 2 * torch.arange(0, head_dim // 2, dtype=torch.float64, device=inputs.device) / head_dim
    timescale = max_wavelength**fraction
    sinusoid_inp = positions[..., None].to(torch.float64) / timescale[None, None, :]
    sinusoid_inp = sinusoid_inp[..., None, :]
    sin = torch.sin(sinusoid_inp).to(inputs.dtype)
    cos = torch.cos(sinusoid_inp).to(inputs.dtype)
    first_half, second_half = torch.chunk(inputs, 2, dim=-1)
    first_part = first_half * cos - second_half * sin
    second_part = second_half * cos + first_half * sin
    return torch.cat([first_part, second_part], dim=-1)


class Attention(nn.Module):
    def __init__(self, num_heads, num_kv_heads, features, head_dim):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.query_pre_attn_scalar = head_dim**-0.5
        s = features**-0.5
        self.q_einsum = Einsum((num_heads, features, head_dim), s)
        self.kv_einsum = Einsum((2, num_kv_heads, features, head_dim), s)
        self.attn_vec_einsum = Einsum((num_heads, head_dim, features), (num_heads * head_dim) ** -0.5)

    def forward(self, x, segment_pos, cache, attn_mask):
        query_proj = self.q_einsum("BTD,NDH->BTNH", x)
        kv = self.kv_einsum("BSD,CKDH->CBSKH", x)
        key_proj, value_proj = kv[0], kv[1]
        query_proj = apply_rope(query_proj, segment_pos, self.head_dim)
        query_scaled = query_proj * self.query_pre_attn_scalar
        key_proj = apply_rope(key_proj, segment_pos, self.head_dim)
        new_cache = None
        if cache is not None:
            start = int(segment_pos[0, 0])
            T = x.shape[1]
            value_proj_all = cache["v"].clone()
            key_proj_all = cache["k"].clone()
            value_proj_all[:, start : start + T] = value_proj
            key_proj_all[:, start : start + T] = key_proj
            new_cache = {"v": value_proj_all, "k": key_proj_all, "end_index": cache["end_index"] + T}
            key_proj, value_proj = key_proj_all, value_proj_all
        B, T, N, H = query_scaled.shape
        K = self.num_kv_heads
        G = N // K
        query_scaled = query_scaled.reshape(B, T, K, G, H)
        logits = torch.einsum("BTKGH,BSKH->BTKGS", query_scaled, key_proj).reshape(B, T, N, -1)
        padded_logits = torch.where(attn_mask[:, :, None, :], logits, torch.tensor(K_MASK, dtype=logits.dtype))
        probs = F.softmax(padded_logits, dim=-1).to(key_proj.dtype)
        probs = probs.reshape(B, T, K, G, -1)
        encoded = torch.einsum("BTKGS,BSKH->BTKGH", probs, value_proj).reshape(B, T, N, H)
        attn_output = self.attn_vec_einsum("BTNH,NHD->BTD", encoded)
        return new_cache, attn_output


class FeedForward(nn.Module):
    def __init__(self, features, hidden_dim):
        super().__init__()
        self.gating_einsum = nn.Parameter(torch.randn(2, features, hidden_dim) * features**-0.5)
        self.linear = nn.Parameter(torch.randn(hidden_dim, features) * hidden_dim**-0.5)

    def forward(self, x):
        ff_gate = torch.einsum("...F,FH->...H", x, self.gating_einsum[0])
        ff1 = torch.einsum("...F,FH->...H", x, self.gating_einsum[1])
        return torch.einsum("...H,HF->...F", F.gelu(ff_gate, approximate="tanh") * ff1, self.linear)


class Block(nn.Module):
    def __init__(self, num_heads, num_kv_heads, embed_dim, head_dim, hidden_dim):
        super().__init__()
        self.pre_attention_norm = RMSNorm(embed_dim)
        self.attn = Attention(num_heads, num_kv_heads, embed_dim, head_dim)
        self.pre_ffw_norm = RMSNorm(embed_dim)
        self.mlp = FeedForward(embed_dim, hidden_dim)

    def forward(self, x, segment_pos, cache, attn_mask):
        cache, attn_output = self.attn(self.pre_attention_norm(x), segment_pos, cache, attn_mask)
        attn_output = attn_output + x
        return cache, self.mlp(self.pre_ffw_norm(attn_output)) + attn_output


class Embedder(nn.Module):
    def __init__(self, vocab_size, embed_dim):
        super().__init__()
        self.input_embedding = nn.Parameter(torch.randn(vocab_size, embed_dim) * embed_dim**-0.5)

    def encode(self, x):
        x = self.input_embedding[x]
        return x * math.sqrt(self.input_embedding.shape[1])

    def decode(self, x):
        return x @ self.input_embedding.T


class Transformer(nn.Module):
    def __init__(self, num_layers=3, vocab_size=128, embed_dim=64, num_heads=4, num_kv_heads=2, head_dim=16,
                 hidden_dim=128):
        super().__init__()
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.embedder = Embedder(vocab_size, embed_dim)
        for i in range(num_layers):
            setattr(self, f"layer_{i}", Block(num_heads, num_kv_heads, embed_dim, head_dim, hidden_dim))
        self.final_norm = RMSNorm(embed_dim)
        self.current_pos = 0

    def reset_kv_cache(self):
        self.current_pos = 0

    def _init_layer_cache(self, batch, dtype, device):
        shape = (batch, CACHE_SIZE, self.num_kv_heads, self.head_dim)
        return {"v": torch.zeros(shape, dtype=dtype, device=device), "k": torch.zeros(shape, dtype=dtype, device=device),
                "end_index": torch.zeros(batch, dtype=torch.long, device=device)}

    def forward(self, last_tokens, cache=None):
        B, T = last_tokens.shape
        x = self.embedder.encode(last_tokens)
        device = last_tokens.device
        if cache is None:
            positions = torch.arange(T, device=device)[None].expand(B, T)
            attn_mask = torch.tril(torch.ones(T, T, dtype=torch.bool, device=device))[None].expand(B, T, T)
        else:
            if self.current_pos == 0:
                cache.reset()
            start = self.current_pos
            positions = (start + torch.arange(T, device=device))[None].expand(B, T)
            slots = torch.arange(CACHE_SIZE, device=device)
            attn_mask = (slots[None, :] <= positions[0][:, None])[None].expand(B, T, CACHE_SIZE)
        new_cache = {}
        for i in range(self.num_layers):
            layer_name = f"layer_{i}"
            layer_cache = None
            if cache is not None:
                layer_cache = cache.layers.get(layer_name) or self._init_layer_cache(B, x.dtype, device)
            layer_cache, x = getattr(self, layer_name)(x, positions, layer_cache, attn_mask)
            new_cache[layer_name] = layer_cache
        if cache is not None:
            if start == 0:  # prefill call
                cache.layers.update(new_cache)
            self.current_pos += T  # _sample_step: new_cache stays local
        x = self.final_norm(x)
        return self.embedder.decode(x)


def make_model():
    torch.manual_seed(0)
    model = Transformer()
    for m in model.modules():
        if isinstance(m, RMSNorm):
            nn.init.uniform_(m.scale, -0.4, 0.4)
    return model.eval()

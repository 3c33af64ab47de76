"""big_vision's Gemma (big_vision/models/ppp/gemma.py, the PaliGemma language model) ported from Flax.

Einsum axis names kept (B batch, T query length, S key length, N heads, K kv heads, G groups, H head
dim, D model dim).  `embedder.input_embedding` scaled by sqrt(D) on the way in and reused (tied) on
the way out; `layers.N` Block = `pre_attention_norm` / `attn` / `pre_ffw_norm` / `mlp`; RMSNorm with
(1 + scale); Attention of the gemma-2b kind: `q_einsum.w` (N, D, H) and `kv_einsum.w` (2, K, D, H)
with K = 1 (MQA, queries viewed "BTKGH"), rope on halves (`apply_rope`, max_wavelength 1e4) from the
token positions, q * H^-0.5, logits "BTKGH,BSKH->BKGTS", `jnp.where(mask, logits, K_MASK)` with
K_MASK = -2.3819763e38, `attn_vec_einsum.w` (N, H, D); gated GELU `FeedForward`.
Decoding: the Flax "cache" collection (per layer `k_cache`/`v_cache` (B, cache_size, K, H) and
`idx`) is written with dynamic_update_slice semantics; every query attends over the whole cache under
the mask `key slot <= query position`.  Here the collection is an explicit `KVCache` object.
Cache: book-cache: `cache = mod.KVCache(n_layers=3)`, `model(prompt, cache=cache)`,
`model(tok, cache=cache)`; `model.reset_kv_cache()` is a no-op; returns the logits tensor.
Correct.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": ["layers.0.attn", "layers.1.attn", "layers.2.attn"],
    "kind": "causal-multihead",
    "cache": "book-cache",
    "style": "big_vision gemma (Flax) ported: einsum kernels q_einsum (N,D,H) / kv_einsum (2,K,D,H) MQA 4/1, "
    "attn_vec_einsum (N,H,D), apply_rope halves 1e4, K_MASK -2.38e38, (1+scale) RMSNorm, tied sqrt(D) embedder; "
    "Flax 'cache' collection (k_cache/v_cache/idx, cache_size 64) as a KVCache object",
}

K_MASK = -2.3819763e38


class KVCache:
    """The Flax 'cache' collection: one dict per layer with k_cache, v_cache, idx."""

    def __init__(self, n_layers, cache_size=64):
        self.n_layers = n_layers
        self.cache_size = cache_size
        self.cache = [None] * n_layers

    def get(self, layer_idx):
        return self.cache[layer_idx]

    def update(self, layer_idx, value):
        self.cache[layer_idx] = value

    def seq_len(self):
        return 0 if self.cache[0] is None else int(self.cache[0]["idx"])

    def reset(self):
        self.cache = [None] * self.n_layers


class Einsum(nn.Module):
    def __init__(self, shape):
        super().__init__()
        self.w = nn.Parameter(torch.randn(shape) * 0.15)

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


class Embedder(nn.Module):
    def __init__(self, vocab_size, embed_dim):
        super().__init__()
        self.input_embedding = nn.Parameter(torch.randn(vocab_size, embed_dim) * 0.5)
        self.embed_dim = embed_dim

    def encode(self, x):
        return self.input_embedding[x] * math.sqrt(self.embed_dim)

    def decode(self, x):
        return x @ self.input_embedding.T


def apply_rope(inputs, positions, max_wavelength=10000):
    """inputs (B, T, N, H); positions (B, T)."""
    head_dim = inputs.shape[-1]
    fraction = 2 * torch.arange(0, head_dim // 2, dtype=torch.float64) / head_dim
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
    def __init__(self, num_heads, num_kv_heads, features, head_dim, cache_size=64):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.cache_size = cache_size
        self.q_einsum = Einsum((num_heads, features, head_dim))
        self.kv_einsum = Einsum((2, num_kv_heads, features, head_dim))
        self.attn_vec_einsum = Einsum((num_heads, head_dim, features))

    def forward(self, x, positions, attn_mask, cache=None, layer_idx=0):
        query_proj = self.q_einsum("BTD,NDH->BTNH", x)
        key_proj, value_proj = self.kv_einsum("BSD,CKDH->CBSKH", x)

        query_proj = apply_rope(query_proj, positions)
        query_proj = query_proj * self.head_dim**-0.5
        key_proj = apply_rope(key_proj, positions)

        if cache is not None:
            b, t = x.shape[:2]
            entry = cache.get(layer_idx)
            if entry is None:
                shape = (b, self.cache_size, self.num_kv_heads, self.head_dim)
                entry = {
                    "k_cache": torch.zeros(shape, dtype=x.dtype, device=x.device),
                    "v_cache": torch.zeros(shape, dtype=x.dtype, device=x.device),
                    "idx": 0,
                }
            idx = entry["idx"]
            # jax.lax.dynamic_update_slice(cache, new, (0, idx, 0, 0))
            k_cache = entry["k_cache"].clone()
            v_cache = entry["v_cache"].clone()
            k_cache[:, idx : idx + t] = key_proj
            v_cache[:, idx : idx + t] = value_proj
            cache.update(layer_idx, {"k_cache": k_cache, "v_cache": v_cache, "idx": idx + t})
            key_proj, value_proj = k_cache, v_cache

        b, t, _, h = query_proj.shape
        query_proj = query_proj.reshape(b, t, self.num_kv_heads, self.num_heads // self.num_kv_heads, h)
        logits = torch.einsum("BTKGH,BSKH->BKGTS", query_proj, key_proj)
        logits = logits.reshape(b, self.num_heads, t, key_proj.shape[1])
        padded_logits = torch.where(attn_mask[:, None, :, :], logits, torch.tensor(K_MASK, dtype=logits.dtype))
        probs = F.softmax(padded_logits, dim=-1)
        probs = probs.reshape(b, self.num_kv_heads, self.num_heads // self.num_kv_heads, t, -1)
        encoded = torch.einsum("BKGTS,BSKH->BTKGH", probs, value_proj)
        encoded = encoded.reshape(b, t, self.num_heads, h)
        return self.attn_vec_einsum("BTNH,NHD->BTD", encoded)


class FeedForward(nn.Module):
    def __init__(self, features, hidden_dim):
        super().__init__()
        self.gating_einsum = nn.Parameter(torch.randn(2, features, hidden_dim) / math.sqrt(features))
        self.linear = nn.Parameter(torch.randn(hidden_dim, features) / math.sqrt(hidden_dim))

    def forward(self, x):
        ff_gate = x @ self.gating_einsum[0]
        gate_value = F.gelu(ff_gate, approximate="tanh")
        ff1 = x @ self.gating_einsum[1]
        return (gate_value * ff1) @ self.linear


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.pre_attention_norm = RMSNorm(config.width)
        self.attn = Attention(config.num_heads, config.num_kv_heads, config.width, config.head_dim)
        self.pre_ffw_norm = RMSNorm(config.width)
        self.mlp = FeedForward(config.width, config.mlp_dim)

    def forward(self, x, positions, attn_mask, cache, layer_idx):
        inputs_normalized = self.pre_attention_norm(x)
        attn_output = self.attn(inputs_normalized, positions, attn_mask, cache, layer_idx)
        attn_output = attn_output + x
        outputs = self.mlp(self.pre_ffw_norm(attn_output))
        return outputs + attn_output


class Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embedder = Embedder(config.vocab_size, config.width)
        self.layers = nn.ModuleList([Block(config) for _ in range(config.depth)])
        self.final_norm = RMSNorm(config.width)

    def reset_kv_cache(self):
        pass

    def forward(self, tokens, cache=None):
        b, t = tokens.shape
        x = self.embedder.encode(tokens)
        start = cache.seq_len() if cache is not None else 0
        positions = (start + torch.arange(t, device=tokens.device))[None, :].expand(b, t)
        if cache is None:
            key_pos = torch.arange(t, device=tokens.device)
        else:
            key_pos = torch.arange(cache.cache_size, device=tokens.device)
        attn_mask = key_pos[None, None, :] <= positions[:, :, None]
        for i, block in enumerate(self.layers):
            x = block(x, positions, attn_mask, cache, i)
        x = self.final_norm(x)
        return self.embedder.decode(x)


def make_model():
    torch.manual_seed(2302)
    config = SimpleNamespace(
        vocab_size=96, width=64, depth=3, mlp_dim=128, num_heads=4, num_kv_heads=1, head_dim=16
    )
    model = Model(config)
    g = torch.Generator().manual_seed(23021)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.scale.copy_(0.3 * torch.randn(m.scale.shape, generator=g))
    return model.eval()

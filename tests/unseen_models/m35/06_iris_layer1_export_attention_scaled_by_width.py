"""IRIS (eloialonso/iris, src/models/world_model.py, transformer.py, kv_caching.py), one token
stream.

WorldModel: embedder (token Embedding) + pos_emb(prev_steps + arange(num_steps)) -> transformer
(Transformer: blocks.N, ln_f) -> head_observations (Linear, ReLU, Linear).  Block is minGPT pre-
LN:
x + attn(ln1(x)), x + mlp(ln2(x)) with a GELU 4x MLP.  SelfAttention: key / query / value / proj
Linear layers with bias, a tril boolean `mask` buffer of max_tokens sliced `mask[L:L + T, :L +
T]`,
`kv_cache.update(k, v); k, v = kv_cache.get()`, F.scaled_dot_product_attention with is_causal
only
when nothing is cached, the 'b h t e -> b t (h e)' merge.  The cache is IRIS's KeysValues object
(one
per-layer store of shape (2, n, heads, max_tokens, head_dim) and a size) passed from outside;
here
the class is named KVCache and each layer store is allocated at its first write.
Cache: book-cache: `cache = mod.KVCache(n_layers=N)`, `model.reset_kv_cache()` (a no-op),
`model(prompt, cache=cache)`, `model(tok, cache=cache)`; returns the logits tensor of the new
rows.
`model(ids)` uses no cache.
Slip: block 1 is an ExportSelfAttention that writes the product out and scales it by
1/sqrt(embed_dim) = 1/8 instead of 1/sqrt(head_dim) = 1/4.

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
        "transformer.blocks.0.attn",
        "transformer.blocks.1.attn",
        "transformer.blocks.2.attn",
    ],
    "kind": "causal-multihead",
    "cache": "book-cache",
    "layer": "transformer.blocks.1.attn",
    "stage": "scaled_scores",
    "mistake": "wrong_scale",
    "style": "IRIS; block 1 uses an export attention written without SDPA that scales q.k "
    "by 1/sqrt(C) (C = 64, width) instead of 1/sqrt(16)",
}


class LayerKV:
    """IRIS's per-layer cache: one (2, n, heads, max_tokens, head_dim) store and a fill size.

    Allocated at its first write (IRIS sizes it from the model's config up front)."""

    def __init__(self, max_tokens):
        self.max_tokens = max_tokens
        self._cache = None
        self._size = 0

    @property
    def shape(self):
        if self._cache is None:
            return 0, 0, 0, 0
        _, n, num_heads, _, head_dim = self._cache.shape
        return n, num_heads, self._size, head_dim

    def reset(self):
        self._cache = None
        self._size = 0

    def get(self):
        k, v = self._cache[:, :, :, : self._size]
        return k, v

    def update(self, k, v):
        if self._cache is None:
            n, num_heads, _, head_dim = k.shape
            self._cache = k.new_zeros(2, n, num_heads, self.max_tokens, head_dim)
        assert self._size + k.size(2) <= self._cache.size(3)
        self._cache[0, :, :, self._size : self._size + k.size(2)] = k
        self._cache[1, :, :, self._size : self._size + v.size(2)] = v
        self._size += k.size(2)


class KVCache:
    """IRIS's KeysValues: one LayerKV per block."""

    def __init__(self, n_layers, max_tokens=64):
        self._keys_values = tuple(LayerKV(max_tokens) for _ in range(n_layers))

    def __getitem__(self, i):
        return self._keys_values[i]

    def __len__(self):
        return len(self._keys_values)

    @property
    def size(self):
        return self._keys_values[0].shape[2]

    def seq_len(self):
        return self.size

    def get(self, i):
        return self._keys_values[i].get()

    def update(self, i, kv):
        self._keys_values[i].update(*kv)

    def reset(self):
        for kv_cache in self._keys_values:
            kv_cache.reset()


class SelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        assert config.embed_dim % config.num_heads == 0
        self.num_heads = config.num_heads
        self.causal = config.attention == "causal"
        self.key = nn.Linear(config.embed_dim, config.embed_dim)
        self.query = nn.Linear(config.embed_dim, config.embed_dim)
        self.value = nn.Linear(config.embed_dim, config.embed_dim)
        self.proj = nn.Linear(config.embed_dim, config.embed_dim)
        causal_mask = torch.tril(torch.ones(config.max_tokens, config.max_tokens))
        self.register_buffer("mask", causal_mask.bool(), persistent=False)

    def forward(self, x, kv_cache=None):
        B, T, C = x.size()
        L = 0 if kv_cache is None else kv_cache.shape[2]
        hs = C // self.num_heads
        q = self.query(x).view(B, T, self.num_heads, hs).transpose(1, 2)
        k = self.key(x).view(B, T, self.num_heads, hs).transpose(1, 2)
        v = self.value(x).view(B, T, self.num_heads, hs).transpose(1, 2)
        if kv_cache is not None:
            kv_cache.update(k, v)
            k, v = kv_cache.get()
        mask = self.mask[L : L + T, : L + T]
        if self.causal and L == 0:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        # rearrange 'b h t e -> b t (h e)'
        y = y.transpose(1, 2).reshape(B, T, C)
        return self.proj(y)


class ExportSelfAttention(SelfAttention):
    """IRIS attention written out for export (no SDPA); the scale is taken from the width."""

    def forward(self, x, kv_cache=None):
        B, T, C = x.size()
        L = 0 if kv_cache is None else kv_cache.shape[2]
        hs = C // self.num_heads
        q = self.query(x).view(B, T, self.num_heads, hs).transpose(1, 2)
        k = self.key(x).view(B, T, self.num_heads, hs).transpose(1, 2)
        v = self.value(x).view(B, T, self.num_heads, hs).transpose(1, 2)
        if kv_cache is not None:
            kv_cache.update(k, v)
            k, v = kv_cache.get()
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(C))
        att = att.masked_fill(~self.mask[L : L + T, : L + T], float("-inf"))
        y = torch.softmax(att, dim=-1) @ v
        y = y.transpose(1, 2).reshape(B, T, C)
        return self.proj(y)


ATTENTION_CLASSES = {"sdpa": SelfAttention, "export": ExportSelfAttention}


class Block(nn.Module):
    def __init__(self, config, attn_cls):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.embed_dim)
        self.ln2 = nn.LayerNorm(config.embed_dim)
        self.attn = attn_cls(config)
        self.mlp = nn.Sequential(
            nn.Linear(config.embed_dim, 4 * config.embed_dim),
            nn.GELU(),
            nn.Linear(4 * config.embed_dim, config.embed_dim),
        )

    def forward(self, x, past_keys_values=None):
        x = x + self.attn(self.ln1(x), past_keys_values)
        return x + self.mlp(self.ln2(x))


class Transformer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList(
            [Block(config, ATTENTION_CLASSES[name]) for name in config.attention_impl]
        )
        self.ln_f = nn.LayerNorm(config.embed_dim)

    def forward(self, sequences, past_keys_values=None):
        x = sequences
        assert past_keys_values is None or len(past_keys_values) == len(self.blocks)
        for i, block in enumerate(self.blocks):
            x = block(x, None if past_keys_values is None else past_keys_values[i])
        return self.ln_f(x)


class WorldModel(nn.Module):
    """IRIS's world model reduced to one token stream: embedder + pos_emb -> Transformer -> head."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embedder = nn.Embedding(config.vocab_size, config.embed_dim)
        self.pos_emb = nn.Embedding(config.max_tokens, config.embed_dim)
        self.transformer = Transformer(config)
        self.head_observations = nn.Sequential(
            nn.Linear(config.embed_dim, config.embed_dim),
            nn.ReLU(),
            nn.Linear(config.embed_dim, config.vocab_size),
        )

    def generate_empty_keys_values(self):
        return KVCache(n_layers=self.config.num_layers, max_tokens=self.config.max_tokens)

    def reset_kv_cache(self):
        # the cache lives outside the model: a new KVCache is the reset
        return None

    def forward(self, tokens, cache=None, past_keys_values=None):
        past_keys_values = cache if cache is not None else past_keys_values
        num_steps = tokens.size(1)
        prev_steps = 0 if past_keys_values is None else past_keys_values.size
        positions = prev_steps + torch.arange(num_steps, device=tokens.device)
        sequences = self.embedder(tokens) + self.pos_emb(positions)
        x = self.transformer(sequences, past_keys_values)
        return self.head_observations(x)


def make_model():
    torch.manual_seed(3506)
    config = SimpleNamespace(
        vocab_size=96,
        embed_dim=64,
        num_heads=4,
        num_layers=3,
        tokens_per_block=16,
        max_blocks=4,
        max_tokens=64,
        attention="causal",
        attention_impl=["sdpa", "export", "sdpa"],
    )
    model = WorldModel(config)
    g = torch.Generator().manual_seed(35061)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
        model.embedder.weight.normal_(0.0, 1.0, generator=g)
        model.pos_emb.weight.normal_(0.0, 1.0, generator=g)
    return model.eval()

"""tjake/Jlama (Java LLM inference) LlamaModel ported to PyTorch.

Jlama splits a model into `embedInput` (token embeddings), `transformerBlocks.N` (TransformerBlock:
`preAttentionNorm`, `attention` = CausalSelfAttention with `queryAttnWeights`, `keyAttnWeights`,
`valueAttnWeights`, `outputProjectionWeights`, `postAttentionNorm`, `ffBlock` with `fullyConnectedWeights`
/ `upProjectionWeights` / `outputProjectionWeights`) and `outputLayer` (final norm + classifier).
CausalSelfAttention: GQA 4/2 (head 16), rotary by halves (Jlama's non-interleaved "neox" path, base
1e4) at the token's absolute position, for each query a loop over the key range [0, position]
expressed here as a boolean range mask, scores / sqrt(head_dim), softmax, weighted values.
The KV cache is Jlama's KvBufferCache: an external object with per-layer (b, s, kv, d) key/value
buffers grown on dim 1 (`KVCache(n_layers)`, `get(i)`, `update(i, (k, v))`, `seq_len()`).
Slip: the single-token path (`batchForward` with one token) computes the first attended key as
`startPosition = position` (a window of one, copied from the sliding-window branch with a null
window) instead of 0, so each decoded token attends only to itself.  The prompt path is exact.
Cache: book-cache: `cache = mod.KVCache(n_layers=3)`, `model(prompt, cache=cache)`,
`model(tok, cache=cache)`; `model.reset_kv_cache()` is a no-op.  Returns the logits tensor.
"""

from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["transformerBlocks.0.attention", "transformerBlocks.1.attention", "transformerBlocks.2.attention"],
    "kind": "causal-multihead",
    "cache": "book-cache",
    "decode": {
        "mistake": "cache_mask",
        "step": 0,
        "layer": "transformerBlocks.0.attention",
    },
    "style": "tjake/Jlama ported: transformerBlocks.N with camelCase Java names, CausalSelfAttention per-query key "
    "range, halves rotary base 1e4, GQA 4/2, KvBufferCache-like external cache; slip: one-token path starts the "
    "key range at the token's own position",
}


class KVCache:
    def __init__(self, n_layers):
        self.cache = [None] * n_layers

    def get(self, layer_idx):
        return self.cache[layer_idx]

    def update(self, layer_idx, value):
        self.cache[layer_idx] = value

    def seq_len(self):
        return 0 if self.cache[0] is None else self.cache[0][0].shape[1]

    def reset(self):
        for i in range(len(self.cache)):
            self.cache[i] = None


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weights = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weights


class CausalSelfAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.numberOfHeads, self.numberOfKeyValueHeads = c.numberOfHeads, c.numberOfKeyValueHeads
        self.headSize = c.embeddingLength // c.numberOfHeads
        self.ropeTheta = c.ropeTheta
        self.queryAttnWeights = nn.Linear(c.embeddingLength, self.numberOfHeads * self.headSize, bias=False)
        self.keyAttnWeights = nn.Linear(c.embeddingLength, self.numberOfKeyValueHeads * self.headSize, bias=False)
        self.valueAttnWeights = nn.Linear(c.embeddingLength, self.numberOfKeyValueHeads * self.headSize, bias=False)
        self.outputProjectionWeights = nn.Linear(self.numberOfHeads * self.headSize, c.embeddingLength, bias=False)

    def rope(self, x, positions):
        d = self.headSize
        inv = 1.0 / (self.ropeTheta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        ang = positions.to(torch.float64)[:, None] * inv[None]
        c, s = ang.cos().to(x.dtype)[None, :, None], ang.sin().to(x.dtype)[None, :, None]
        a, b = x[..., : d // 2], x[..., d // 2:]
        return torch.cat([a * c - b * s, b * c + a * s], dim=-1)

    def forward(self, x, startPos, layerCache):
        B, T, _ = x.shape
        positions = startPos + torch.arange(T)
        q = self.rope(self.queryAttnWeights(x).view(B, T, -1, self.headSize), positions)
        k = self.rope(self.keyAttnWeights(x).view(B, T, -1, self.headSize), positions)
        v = self.valueAttnWeights(x).view(B, T, -1, self.headSize)
        if layerCache is not None:
            k = torch.cat([layerCache[0], k], dim=1)
            v = torch.cat([layerCache[1], v], dim=1)
        S = k.shape[1]
        group = self.numberOfHeads // self.numberOfKeyValueHeads
        kh = torch.arange(self.numberOfHeads) // group
        scores = torch.einsum("bthd,bshd->bhts", q, k[:, :, kh]) / (self.headSize**0.5)
        keyPos = torch.arange(S)[None, :]
        if T == 1:
            rangeStart = positions[:, None]
        else:
            rangeStart = torch.zeros(T, 1, dtype=torch.long)
        visible = (keyPos >= rangeStart) & (keyPos <= positions[:, None])
        scores = scores.masked_fill(~visible.to(x.device), float("-inf"))
        out = torch.einsum("bhts,bshd->bthd", scores.softmax(-1), v[:, :, kh])
        return self.outputProjectionWeights(out.reshape(B, T, -1)), (k, v)


class MLPBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.fullyConnectedWeights = nn.Linear(c.embeddingLength, c.hiddenLength, bias=False)
        self.upProjectionWeights = nn.Linear(c.embeddingLength, c.hiddenLength, bias=False)
        self.outputProjectionWeights = nn.Linear(c.hiddenLength, c.embeddingLength, bias=False)

    def forward(self, x):
        return self.outputProjectionWeights(F.silu(self.fullyConnectedWeights(x)) * self.upProjectionWeights(x))


class TransformerBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.preAttentionNorm = RMSNorm(c.embeddingLength)
        self.attention = CausalSelfAttention(c)
        self.postAttentionNorm = RMSNorm(c.embeddingLength)
        self.ffBlock = MLPBlock(c)

    def forward(self, x, startPos, layerCache):
        a, newCache = self.attention(self.preAttentionNorm(x), startPos, layerCache)
        x = x + a
        return x + self.ffBlock(self.postAttentionNorm(x)), newCache


class OutputLayer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.outputLayerNorm = RMSNorm(c.embeddingLength)
        self.classificationWeights = nn.Linear(c.embeddingLength, c.vocabularySize, bias=False)

    def forward(self, x):
        return self.classificationWeights(self.outputLayerNorm(x))


class LlamaModel(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embedInput = nn.Embedding(c.vocabularySize, c.embeddingLength)
        self.transformerBlocks = nn.ModuleList([TransformerBlock(c) for _ in range(c.numberOfLayers)])
        self.outputLayer = OutputLayer(c)

    def reset_kv_cache(self):
        pass

    def forward(self, tokenIds, cache=None):
        startPos = cache.seq_len() if cache is not None else 0
        x = self.embedInput(tokenIds)
        for i, block in enumerate(self.transformerBlocks):
            x, newCache = block(x, startPos, cache.get(i) if cache is not None else None)
            if cache is not None:
                cache.update(i, newCache)
        return self.outputLayer(x)


def make_model():
    torch.manual_seed(2012)
    c = SimpleNamespace(vocabularySize=96, embeddingLength=64, hiddenLength=128, numberOfLayers=3,
                        numberOfHeads=4, numberOfKeyValueHeads=2, ropeTheta=10000.0)
    model = LlamaModel(c)
    g = torch.Generator().manual_seed(20121)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weights.copy_(1.0 + 0.3 * torch.randn(m.weights.shape, generator=g))
    return model.eval()

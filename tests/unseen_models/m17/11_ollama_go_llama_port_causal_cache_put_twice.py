"""ollama's Go engine Llama (model/models/llama/model.go + kvcache/causal.go + ml/nn) ported to torch.

Model: TokenEmbedding, Layers.N (AttentionNorm, SelfAttention, MLPNorm, MLP), OutputNorm, Output: the
Go struct field names are kept as attribute names.  SelfAttention holds Query/Key/Value/Output Linears
(gguf attn_q/attn_k/attn_v/attn_output), reshapes to (b, s, heads, d), applies fast.RoPE in the
"normal" (adjacent pairs, interleaved) type with base 5e5 at the batch's Positions, and calls
nn.Attention(q, k, v, scale=1/sqrt(headDim), cache): the cache Puts the new keys/values with their
positions, Gets every stored cell, and the causal mask comes from the cells' positions (cell visible
when its position <= the query's).  GQA 4/2 (query head h uses kv head h // 2).  MLP: Gate/Up/Down SiLU.
Cache: book-cache: `cache = mod.KVCache(n_layers=3)` (kvcache.Causal stand-in: set_layer, put,
get, with update(i, (k, v)), get(i) and seq_len() on top), `model(prompt, cache=cache)`,
`model(tok, cache=cache)`; positions come from the cache's token counter.  `model.reset_kv_cache()` is a
no-op.  Returns the logits tensor.
Slip: after the layer loop, Forward "commits" the batch by calling cache.put(k, v) again for every
layer with the batch it just stored (a leftover of a two-phase put/commit from a batching change), so
every batch is stored twice: the prompt pass itself is exact, but from step 0 each token sees every
earlier key twice.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["Layers.0.SelfAttention", "Layers.1.SelfAttention", "Layers.2.SelfAttention"],
    "kind": "causal-multihead",
    "cache": "book-cache",
    "decode": {"mistake": "cache_stale", "step": 0, "layer": "Layers.0.SelfAttention"},
    "style": "ollama Go engine llama ported: Go field names (TokenEmbedding, Layers.N.SelfAttention Query/Key/Value/"
    "Output, AttentionNorm, MLPNorm, OutputNorm, Output), fast.RoPE normal (interleaved) base 5e5, kvcache.Causal "
    "cells with positions and a position-built mask, GQA 4/2; a leftover commit puts every batch a second time",
}


class KVCache:
    """kvcache.Causal stand-in: per layer, a list of stored (k, v, positions) cells."""

    def __init__(self, n_layers):
        self.n_layers = n_layers
        self.cells = [None] * n_layers
        self.cur_layer = 0
        self.num_tokens = 0
        self.last = [None] * n_layers

    def set_layer(self, i):
        self.cur_layer = i

    def put(self, k, v, positions):
        i = self.cur_layer
        self.last[i] = (k, v, positions)
        if self.cells[i] is None:
            self.cells[i] = (k, v, positions)
        else:
            pk, pv, pp = self.cells[i]
            self.cells[i] = (torch.cat([pk, k], 1), torch.cat([pv, v], 1), torch.cat([pp, positions], 0))

    def get_cells(self):
        return self.cells[self.cur_layer]

    # book-cache face
    def update(self, i, kv):
        self.cells[i] = (kv[0], kv[1], torch.arange(kv[0].shape[1]))

    def get(self, i):
        c = self.cells[i]
        return None if c is None else (c[0], c[1])

    def seq_len(self):
        return self.num_tokens


def rope_normal(x, positions, base):
    # fast.RoPE, normal type: adjacent pairs (x[2i], x[2i+1]) rotated by positions * base^(-2i/d)
    d = x.shape[-1]
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = positions.to(torch.float64)[:, None] * inv[None, :]
    c = ang.cos().to(x.dtype)[None, :, None, :]
    s = ang.sin().to(x.dtype)[None, :, None, :]
    xr = x.reshape(*x.shape[:-1], -1, 2)
    a, b = xr[..., 0], xr[..., 1]
    return torch.stack([a * c - b * s, a * s + b * c], dim=-1).reshape(x.shape)


class SelfAttention(nn.Module):
    def __init__(self, opts):
        super().__init__()
        self.opts = opts
        d = opts.hiddenSize
        self.headDim = d // opts.numHeads
        self.Query = nn.Linear(d, opts.numHeads * self.headDim, bias=False)
        self.Key = nn.Linear(d, opts.numKVHeads * self.headDim, bias=False)
        self.Value = nn.Linear(d, opts.numKVHeads * self.headDim, bias=False)
        self.Output = nn.Linear(opts.numHeads * self.headDim, d, bias=False)

    def forward(self, hidden_state, positions, cache):
        o = self.opts
        b, s, _ = hidden_state.shape
        q = self.Query(hidden_state).view(b, s, o.numHeads, self.headDim)
        q = rope_normal(q, positions, o.ropeBase)
        k = self.Key(hidden_state).view(b, s, o.numKVHeads, self.headDim)
        k = rope_normal(k, positions, o.ropeBase)
        v = self.Value(hidden_state).view(b, s, o.numKVHeads, self.headDim)
        if cache is not None:
            cache.put(k, v, positions)
            k, v, kpos = cache.get_cells()
        else:
            kpos = positions
        # nn.Attention: scaled dot product with the cache's mask
        n_rep = o.numHeads // o.numKVHeads
        kh = k.repeat_interleave(n_rep, dim=2).transpose(1, 2)
        vh = v.repeat_interleave(n_rep, dim=2).transpose(1, 2)
        qh = q.transpose(1, 2)
        kq = torch.matmul(qh, kh.transpose(-1, -2)) * (1.0 / math.sqrt(self.headDim))
        mask = kpos[None, :] > positions[:, None]
        kq = kq.masked_fill(mask, float("-inf"))
        kq = torch.softmax(kq, dim=-1)
        kqv = torch.matmul(kq, vh).transpose(1, 2).reshape(b, s, -1)
        return self.Output(kqv)


class MLP(nn.Module):
    def __init__(self, opts):
        super().__init__()
        self.Gate = nn.Linear(opts.hiddenSize, opts.ffnSize, bias=False)
        self.Up = nn.Linear(opts.hiddenSize, opts.ffnSize, bias=False)
        self.Down = nn.Linear(opts.ffnSize, opts.hiddenSize, bias=False)

    def forward(self, x):
        return self.Down(F.silu(self.Gate(x)) * self.Up(x))


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.Weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return self.Weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class Layer(nn.Module):
    def __init__(self, opts):
        super().__init__()
        self.AttentionNorm = RMSNorm(opts.hiddenSize, opts.eps)
        self.SelfAttention = SelfAttention(opts)
        self.MLPNorm = RMSNorm(opts.hiddenSize, opts.eps)
        self.MLP = MLP(opts)

    def forward(self, hidden_state, positions, cache):
        residual = hidden_state
        hidden_state = self.SelfAttention(self.AttentionNorm(hidden_state), positions, cache)
        hidden_state = hidden_state + residual
        residual = hidden_state
        return self.MLP(self.MLPNorm(hidden_state)) + residual


class Model(nn.Module):
    def __init__(self, opts):
        super().__init__()
        self.opts = opts
        self.TokenEmbedding = nn.Embedding(opts.vocabSize, opts.hiddenSize)
        self.Layers = nn.ModuleList([Layer(opts) for _ in range(opts.numLayers)])
        self.OutputNorm = RMSNorm(opts.hiddenSize, opts.eps)
        self.Output = nn.Linear(opts.hiddenSize, opts.vocabSize, bias=False)

    def reset_kv_cache(self):
        pass

    def forward(self, inputs, cache=None):
        b, s = inputs.shape
        start = cache.seq_len() if cache is not None else 0
        positions = torch.arange(start, start + s)
        hidden_state = self.TokenEmbedding(inputs)
        for i, layer in enumerate(self.Layers):
            if cache is not None:
                cache.set_layer(i)
            hidden_state = layer(hidden_state, positions, cache)
        if cache is not None:
            for i in range(len(self.Layers)):
                cache.set_layer(i)
                k, v, p = cache.last[i]
                cache.put(k, v, p)  # commit
            cache.num_tokens += s
        return self.Output(self.OutputNorm(hidden_state))


def make_model():
    torch.manual_seed(1711)
    opts = SimpleNamespace(
        hiddenSize=64, numHeads=4, numKVHeads=2, numLayers=3, ffnSize=160, vocabSize=96, eps=1e-5, ropeBase=500000.0
    )
    model = Model(opts)
    g = torch.Generator().manual_seed(17111)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.Weight.copy_(1.0 + 0.3 * torch.randn(m.Weight.shape, generator=g))
    return model.eval()

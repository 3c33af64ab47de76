"""mukel/llama3.java (Llama3.java: Llama, Configuration, Weights, State) ported to torch, batched.

Weights keep llama3.java's names: token_embedding_table, per layer rms_att_weight, wq/wk/wv/wo,
rms_ffn_weight, w1/w2/w3, then rms_final_weight and wcls; the per-layer tensors live in
layers.N (LayerWeights with an `attention` submodule holding wq/wk/wv/wo as (out, in) matrices).
RoPE from RoPE.precomputeFreqsCis: freq_cis_real / freq_cis_imag tables (float64 here, cast at use)
applied to adjacent pairs (interleaved), base 5e5.  GQA 4/2 (kvMul = 2: query head h reads kv head
h / kvMul).  Attention as in forward(): scores q.k / sqrt(headSize) for keys 0..position, softmax,
weighted sum of values.  State holds keyCache/valueCache (b, 64, kv_dim) per layer.
Cache: book-buffers: `model.reset_kv_cache()`, `model(ids, use_cache=True)`, `model(tok, use_cache=True)`.
`model(ids)` without use_cache is the full forward and touches no cache.  Returns the logits tensor.
Slip: llama3.java feeds one token per forward() call and the port keeps its `state.position += 1` at
the end of each call, while the cache slots are written from `state.latestToken`-style lengths
(state.length, the real number of cached tokens).  After a batched prompt of L tokens the next token
is rotated at position 1 instead of L: the cache and the mask are right, the rotary is not.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["layers.0.attention", "layers.1.attention", "layers.2.attention"],
    "kind": "causal-multihead",
    "cache": "book-buffers",
    "decode": {"mistake": "cache_positions", "step": 0, "layer": "layers.0.attention"},
    "style": "llama3.java ported: Weights names (token_embedding_table, rms_att_weight, wq..wo, w1..w3, wcls), "
    "freq_cis_real/imag interleaved rotary base 5e5, GQA 4/2 via kvMul, State keyCache/valueCache; "
    "state.position advanced once per call (one-token design) while cache writes use the real length",
}


def precompute_freqs_cis(context_length, head_size, theta):
    inv = 1.0 / (theta ** (torch.arange(0, head_size, 2, dtype=torch.float64) / head_size))
    t = torch.arange(context_length, dtype=torch.float64)
    f = torch.outer(t, inv)
    return torch.cos(f), torch.sin(f)


def rope_rotate(x, fcr, fci):
    # x: (b, T, heads, d); fcr/fci: (T, d/2); adjacent pairs (x[2i], x[2i+1])
    xr = x.reshape(*x.shape[:-1], -1, 2)
    v0, v1 = xr[..., 0], xr[..., 1]
    c, s = fcr[None, :, None, :], fci[None, :, None, :]
    return torch.stack([v0 * c - v1 * s, v0 * s + v1 * c], dim=-1).reshape(x.shape)


def rmsnorm(x, weight, eps):
    ss = x.pow(2).mean(-1, keepdim=True) + eps
    return weight * (x / torch.sqrt(ss))


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.n_heads = c.numberOfHeads
        self.n_kv = c.numberOfKeyValueHeads
        self.head_size = c.dim // c.numberOfHeads
        self.kv_mul = self.n_heads // self.n_kv
        kv_dim = self.n_kv * self.head_size
        self.wq = nn.Parameter(torch.randn(c.dim, c.dim) / math.sqrt(c.dim))
        self.wk = nn.Parameter(torch.randn(kv_dim, c.dim) / math.sqrt(c.dim))
        self.wv = nn.Parameter(torch.randn(kv_dim, c.dim) / math.sqrt(c.dim))
        self.wo = nn.Parameter(torch.randn(c.dim, c.dim) / math.sqrt(c.dim))
        self.key_cache = None
        self.value_cache = None

    def forward(self, x, fcr, fci, state=None):
        B, T, _ = x.shape
        q = (x @ self.wq.T).view(B, T, self.n_heads, self.head_size)
        k = (x @ self.wk.T).view(B, T, self.n_kv, self.head_size)
        v = (x @ self.wv.T).view(B, T, self.n_kv, self.head_size)
        q = rope_rotate(q, fcr, fci)
        k = rope_rotate(k, fcr, fci)
        start = 0
        if state is not None:
            start = state.length
            if self.key_cache is None or self.key_cache.dtype != x.dtype or self.key_cache.shape[0] != B:
                self.key_cache = torch.zeros(B, state.context_length, self.n_kv, self.head_size, dtype=x.dtype)
                self.value_cache = torch.zeros_like(self.key_cache)
            self.key_cache[:, start : start + T] = k
            self.value_cache[:, start : start + T] = v
            k = self.key_cache[:, : start + T]
            v = self.value_cache[:, : start + T]
        # query head h uses kv head h // kvMul
        k = k.repeat_interleave(self.kv_mul, dim=2)
        v = v.repeat_interleave(self.kv_mul, dim=2)
        att = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(self.head_size)
        qpos = torch.arange(start, start + T)[:, None]
        kpos = torch.arange(start + T)[None, :]
        att = att.masked_fill(kpos > qpos, float("-inf"))
        att = torch.softmax(att, dim=-1)
        out = torch.einsum("bhqk,bkhd->bqhd", att, v).reshape(B, T, -1)
        return out @ self.wo.T


class LayerWeights(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.rms_att_weight = nn.Parameter(torch.ones(c.dim))
        self.attention = Attention(c)
        self.rms_ffn_weight = nn.Parameter(torch.ones(c.dim))
        self.w1 = nn.Parameter(torch.randn(c.hiddenDim, c.dim) / math.sqrt(c.dim))
        self.w2 = nn.Parameter(torch.randn(c.dim, c.hiddenDim) / math.sqrt(c.hiddenDim))
        self.w3 = nn.Parameter(torch.randn(c.hiddenDim, c.dim) / math.sqrt(c.dim))


class State:
    def __init__(self, context_length):
        self.context_length = context_length
        self.position = 0
        self.length = 0


class Llama(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.configuration = c
        self.token_embedding_table = nn.Parameter(torch.randn(c.vocabularySize, c.dim))
        self.layers = nn.ModuleList([LayerWeights(c) for _ in range(c.numberOfLayers)])
        self.rms_final_weight = nn.Parameter(torch.ones(c.dim))
        self.wcls = nn.Parameter(torch.randn(c.vocabularySize, c.dim) / math.sqrt(c.dim))
        self.state = State(c.contextLength)

    def reset_kv_cache(self):
        self.state = State(self.configuration.contextLength)
        for layer in self.layers:
            layer.attention.key_cache = None
            layer.attention.value_cache = None

    def forward(self, tokens, use_cache=False):
        c = self.configuration
        B, T = tokens.shape
        x = self.token_embedding_table[tokens]
        state = self.state if use_cache else None
        position = state.position if state is not None else 0
        fcr, fci = precompute_freqs_cis(c.contextLength, c.dim // c.numberOfHeads, c.ropeTheta)
        fcr = fcr[position : position + T].to(x.dtype)
        fci = fci[position : position + T].to(x.dtype)
        for layer in self.layers:
            xb = rmsnorm(x, layer.rms_att_weight, c.rmsNormEps)
            x = x + layer.attention(xb, fcr, fci, state)
            xb = rmsnorm(x, layer.rms_ffn_weight, c.rmsNormEps)
            x = x + (torch.nn.functional.silu(xb @ layer.w1.T) * (xb @ layer.w3.T)) @ layer.w2.T
        if state is not None:
            state.length += T
            state.position += 1  # one token per forward() in llama3.java
        x = rmsnorm(x, self.rms_final_weight, c.rmsNormEps)
        return x @ self.wcls.T


def make_model():
    torch.manual_seed(1710)
    c = SimpleNamespace(
        dim=64,
        hiddenDim=160,
        numberOfLayers=3,
        numberOfHeads=4,
        numberOfKeyValueHeads=2,
        vocabularySize=96,
        contextLength=64,
        rmsNormEps=1e-5,
        ropeTheta=500000.0,
    )
    model = Llama(c)
    g = torch.Generator().manual_seed(17101)
    with torch.no_grad():
        for layer in model.layers:
            layer.rms_att_weight.copy_(1.0 + 0.3 * torch.randn(c.dim, generator=g))
            layer.rms_ffn_weight.copy_(1.0 + 0.3 * torch.randn(c.dim, generator=g))
        model.rms_final_weight.copy_(1.0 + 0.3 * torch.randn(c.dim, generator=g))
    return model.eval()

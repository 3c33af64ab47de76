"""xjdr-alt/entropix torch_model.py (Llama 3.x inference in plain torch) with its functions wrapped
in modules so each layer's attention is its own module.

Transformer: tok_embeddings, layers.N (attention_norm, attention, ffn_norm, feed_forward), norm, output.
The attention module holds entropix's LayerWeights wq/wk/wv/wo as raw (out, in) matrices applied with
F.linear, reshapes to (bsz, seqlen, heads, head_dim), applies the complex freqs_cis rotary
(view_as_complex of (-1, 2) pairs: interleaved) with Llama-3.1 apply_scaling (factor 8, low 1, high 4,
original 8192) on base 5e5, asks the KVCache for the keys/values (written at cur_pos, repeated to the
query heads with repeat_interleave), then einsum scores / sqrt(head_dim) + attn_mask, DEFAULT_MASK_VALUE
padding and a float32 softmax, einsum with the values and wo.  GQA 8/2, head_dim 8.  The causal mask
is entropix's build_attn_mask: -inf triu(1) hstacked after zeros for start_pos columns, only for
seqlen > 1.  (entropix's own decode relies on zero-filled cache slots scoring exactly 0 and being
masked; here the cache returns only the filled length instead.)
Cache: book-cache.  `cache = mod.KVCache(n_layers=3)` (entropix's update(xk, xv, layer_idx, cur_pos,
n_rep) plus get(i) and seq_len()), `model(prompt, cache=cache)`, `model(tok, cache=cache)`;
cur_pos is read from the cache.  `model.reset_kv_cache()` is a no-op.  Returns the logits tensor.
Correct model.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": ["layers.0.attention", "layers.1.attention", "layers.2.attention"],
    "kind": "causal-multihead",
    "cache": "book-cache",
    "decode": {"mistake": None, "step": None, "layer": None},
    "style": "entropix torch_model.py: raw wq/wk/wv/wo via F.linear, complex freqs_cis (interleaved) with "
    "Llama-3.1 apply_scaling base 5e5, GQA 8/2 head_dim 8, KVCache.update(xk, xv, layer_idx, cur_pos, n_rep) "
    "returning repeat_interleaved keys, einsum scores + build_attn_mask, DEFAULT_MASK_VALUE, float32 softmax",
}

DEFAULT_MASK_VALUE = -0.7 * float(torch.finfo(torch.float32).max)


class KVCache:
    """entropix KVCache (one object for all layers), with the get/update/seq_len face of a book cache."""

    def __init__(self, n_layers, max_seq_len=64):
        self.n_layers = n_layers
        self.max_seq_len = max_seq_len
        self.k = None
        self.v = None
        self.filled = [0] * n_layers

    def _alloc(self, xk):
        bsz, _, kvh, hd = xk.shape
        shape = (self.n_layers, bsz, self.max_seq_len, kvh, hd)
        self.k = torch.zeros(shape, dtype=xk.dtype, device=xk.device)
        self.v = torch.zeros(shape, dtype=xk.dtype, device=xk.device)

    def update(self, xk, xv, layer_idx, cur_pos, n_rep):
        if self.k is None or self.k.dtype != xk.dtype or self.k.shape[1] != xk.shape[0]:
            self._alloc(xk)
        seqlen = xk.shape[1]
        self.k[layer_idx, :, cur_pos : cur_pos + seqlen] = xk
        self.v[layer_idx, :, cur_pos : cur_pos + seqlen] = xv
        self.filled[layer_idx] = cur_pos + seqlen
        if cur_pos == 0:
            keys = xk.repeat_interleave(n_rep, dim=2)
            values = xv.repeat_interleave(n_rep, dim=2)
        else:
            keys = self.k[layer_idx, :, : cur_pos + seqlen].repeat_interleave(n_rep, dim=2)
            values = self.v[layer_idx, :, : cur_pos + seqlen].repeat_interleave(n_rep, dim=2)
        return keys, values

    def get(self, layer_idx):
        if self.k is None or self.filled[layer_idx] == 0:
            return None
        n = self.filled[layer_idx]
        return self.k[layer_idx, :, :n], self.v[layer_idx, :, :n]

    def seq_len(self):
        return self.filled[0]


def apply_scaling(freqs):
    scale_factor, low_freq_factor, high_freq_factor, old_context_len = 8.0, 1.0, 4.0, 8192
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / freqs
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    scaled = torch.where(
        wavelen < high_freq_wavelen,
        freqs,
        torch.where(wavelen > low_freq_wavelen, freqs / scale_factor, (1 - smooth) * freqs / scale_factor + smooth * freqs),
    )
    return scaled


def precompute_freqs_cis(dim, end, theta=500000.0, use_scaled=True):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64)[: (dim // 2)] / dim))
    if use_scaled:
        freqs = apply_scaling(freqs)
    t = torch.arange(end, dtype=torch.float64)
    freqs = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(freqs), freqs)  # complex128


def apply_rotary_emb(xq, xk, freqs_cis):
    dtype = xq.dtype
    cdtype = torch.float64
    reshape_xq = xq.to(cdtype).reshape(*xq.shape[:-1], -1, 2)
    reshape_xk = xk.to(cdtype).reshape(*xk.shape[:-1], -1, 2)
    xq_ = torch.complex(reshape_xq[..., 0], reshape_xq[..., 1])
    xk_ = torch.complex(reshape_xk[..., 0], reshape_xk[..., 1])
    xq_out = xq_ * freqs_cis[None, :, None, :]
    xk_out = xk_ * freqs_cis[None, :, None, :]
    xq_out = torch.stack((xq_out.real, xq_out.imag), dim=-1).reshape(*xq_out.shape[:-1], -1)
    xk_out = torch.stack((xk_out.real, xk_out.imag), dim=-1).reshape(*xk_out.shape[:-1], -1)
    return xq_out.to(dtype), xk_out.to(dtype)


def build_attn_mask(seqlen, start_pos, dtype):
    mask = None
    if seqlen > 1:
        mask = torch.full((seqlen, seqlen), float("-inf"))
        mask = torch.triu(mask, diagonal=1)
        mask = torch.hstack([torch.zeros((seqlen, start_pos)), mask]).to(dtype)
    return mask


def rms_norm(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(torch.pow(x, 2).mean(-1, keepdim=True) + eps))


class RMSNormWeight(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return rms_norm(x, self.weight)


class Attention(nn.Module):
    def __init__(self, params, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_local_heads = params.n_local_heads
        self.n_local_kv_heads = params.n_local_kv_heads
        self.head_dim = params.head_dim
        self.n_rep = self.n_local_heads // self.n_local_kv_heads
        d = params.dim
        self.wq = nn.Parameter(torch.randn(self.n_local_heads * self.head_dim, d) / math.sqrt(d))
        self.wk = nn.Parameter(torch.randn(self.n_local_kv_heads * self.head_dim, d) / math.sqrt(d))
        self.wv = nn.Parameter(torch.randn(self.n_local_kv_heads * self.head_dim, d) / math.sqrt(d))
        self.wo = nn.Parameter(torch.randn(d, self.n_local_heads * self.head_dim) / math.sqrt(d))

    def forward(self, x, cur_pos, freqs_cis, kvcache, attn_mask):
        bsz, seqlen, _ = x.shape
        xq = F.linear(x, self.wq).reshape(bsz, seqlen, self.n_local_heads, self.head_dim)
        xk = F.linear(x, self.wk).reshape(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
        xv = F.linear(x, self.wv).reshape(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        if kvcache is not None:
            keys, values = kvcache.update(xk, xv, self.layer_idx, cur_pos, self.n_rep)
        else:
            keys = xk.repeat_interleave(self.n_rep, dim=2)
            values = xv.repeat_interleave(self.n_rep, dim=2)
        xq = xq.permute(0, 2, 1, 3)  # (bs, n_heads, seqlen, head_dim)
        keys = keys.permute(0, 2, 3, 1)  # (bs, n_heads, head_dim, cache_len + seqlen)
        values = values.permute(0, 2, 1, 3)
        scores = torch.matmul(xq, keys)
        scores = scores / math.sqrt(self.head_dim)
        if attn_mask is not None:
            scores = scores + attn_mask
        padded_logits = torch.where(scores >= DEFAULT_MASK_VALUE * 0.5, scores, DEFAULT_MASK_VALUE)
        sm_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        scores = F.softmax(padded_logits, dim=-1, dtype=sm_dtype).to(x.dtype)
        output = torch.matmul(scores, values)
        output = output.transpose(1, 2).reshape(bsz, seqlen, -1)
        return F.linear(output, self.wo)


class FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(hidden, dim) / math.sqrt(dim))
        self.w2 = nn.Parameter(torch.randn(dim, hidden) / math.sqrt(hidden))
        self.w3 = nn.Parameter(torch.randn(hidden, dim) / math.sqrt(dim))

    def forward(self, x):
        return F.linear(F.silu(F.linear(x, self.w1)) * F.linear(x, self.w3), self.w2)


class Layer(nn.Module):
    def __init__(self, params, layer_idx):
        super().__init__()
        self.attention_norm = RMSNormWeight(params.dim)
        self.attention = Attention(params, layer_idx)
        self.ffn_norm = RMSNormWeight(params.dim)
        self.feed_forward = FeedForward(params.dim, params.hidden_dim)


class Transformer(nn.Module):
    def __init__(self, params):
        super().__init__()
        self.params = params
        self.tok_embeddings = nn.Embedding(params.vocab_size, params.dim)
        self.layers = nn.ModuleList([Layer(params, i) for i in range(params.n_layers)])
        self.norm = RMSNormWeight(params.dim)
        self.output = nn.Parameter(torch.randn(params.vocab_size, params.dim) / math.sqrt(params.dim))

    def reset_kv_cache(self):
        pass

    def forward(self, tokens, cache=None):
        bsz, seqlen = tokens.shape
        cur_pos = cache.seq_len() if cache is not None else 0
        h = self.tok_embeddings(tokens)
        freqs_cis = precompute_freqs_cis(self.params.head_dim, self.params.max_seq_len, self.params.rope_theta)
        freqs_cis = freqs_cis[cur_pos : cur_pos + seqlen]
        attn_mask = build_attn_mask(seqlen, cur_pos, h.dtype)
        for layer in self.layers:
            h_attn = layer.attention(layer.attention_norm(h), cur_pos, freqs_cis, cache, attn_mask)
            h = h + h_attn
            h = h + layer.feed_forward(layer.ffn_norm(h))
        return F.linear(self.norm(h), self.output)


def make_model():
    torch.manual_seed(1703)
    params = SimpleNamespace(
        vocab_size=96,
        dim=64,
        n_layers=3,
        n_local_heads=8,
        n_local_kv_heads=2,
        head_dim=8,
        hidden_dim=128,
        rope_theta=500000.0,
        max_seq_len=64,
    )
    model = Transformer(params)
    g = torch.Generator().manual_seed(17031)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNormWeight):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

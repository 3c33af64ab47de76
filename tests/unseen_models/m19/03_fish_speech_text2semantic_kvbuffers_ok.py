"""fish-speech's text-to-semantic LLaMA (fish_speech/models/text2semantic/llama.py, BaseTransformer)
reduced to its text backbone (no codebook heads, no fast transformer).

embeddings, layers.N (TransformerBlock: attention_norm, attention, ffn_norm, feed_forward), norm, and
an output Linear.  Attention: one fused `wqkv` Linear split by sizes [dim, kv_size, kv_size] and `wo`,
GQA 4/2 (head_dim 16) widened with repeat_interleave, real-valued `freqs_cis` table (positions x d/2 x
2 holding cos and sin) applied to adjacent pairs (x[2i], x[2i+1]) -- interleaved pairing, base 1e4 --
then F.scaled_dot_product_attention with a boolean mask row picked from the `causal_mask` buffer at
`input_pos`.  RMSNorm everywhere, SwiGLU w1/w2/w3.
Cache: book-buffers.  `setup_caches(max_batch_size=4, max_seq_len=64)` (called in make_model) gives each
attention a KVCache module with `k_cache`/`v_cache` buffers (b, kv, 64, d) written at `input_pos`.
Drive it with `model(prompt, start_pos=0)`, `model(tok, start_pos=L)`; or `model.reset_kv_cache()`,
`model(prompt, use_cache=True)`, `model(tok, use_cache=True)`.  `model(ids)` with neither is the
full causal forward and touches no cache.  Returns the logits tensor.  Correct.
"""

from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": [
        "layers.0.attention",
        "layers.1.attention",
        "layers.2.attention",
    ],
    "kind": "causal-multihead",
    "cache": "book-buffers",
    "style": "fish-speech text2semantic llama.py BaseTransformer: fused wqkv split by sizes, GQA 4/2 "
    "repeat_interleave, real (cos, sin) freqs_cis on adjacent pairs, SDPA with causal_mask[input_pos] rows, "
    "gpt-fast-like KVCache buffers written at input_pos",
}


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        out = x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + self.eps)
        return out * self.weight


def precompute_freqs_cis(seq_len, n_elem, base=10000):
    freqs = 1.0 / (base ** (torch.arange(0, n_elem, 2, dtype=torch.float64)[: (n_elem // 2)] / n_elem))
    t = torch.arange(seq_len, dtype=torch.float64)
    freqs = torch.outer(t, freqs)
    return torch.stack([torch.cos(freqs), torch.sin(freqs)], dim=-1)  # (seq, d/2, 2), float64


def apply_rotary_emb(x, freqs_cis):
    xshaped = x.reshape(*x.shape[:-1], -1, 2)
    freqs_cis = freqs_cis.view(1, xshaped.size(1), 1, xshaped.size(3), 2).to(x.dtype)
    x_out2 = torch.stack(
        [
            xshaped[..., 0] * freqs_cis[..., 0] - xshaped[..., 1] * freqs_cis[..., 1],
            xshaped[..., 1] * freqs_cis[..., 0] + xshaped[..., 0] * freqs_cis[..., 1],
        ],
        -1,
    )
    return x_out2.flatten(3)


class KVCache(nn.Module):
    def __init__(self, max_batch_size, max_seq_len, n_heads, head_dim, dtype=torch.float32):
        super().__init__()
        cache_shape = (max_batch_size, n_heads, max_seq_len, head_dim)
        self.register_buffer("k_cache", torch.zeros(cache_shape, dtype=dtype))
        self.register_buffer("v_cache", torch.zeros(cache_shape, dtype=dtype))

    def update(self, input_pos, k_val, v_val):
        bsz = k_val.shape[0]
        k_out = self.k_cache
        v_out = self.v_cache
        k_out[:bsz, :, input_pos] = k_val
        v_out[:bsz, :, input_pos] = v_val
        return k_out[:bsz], v_out[:bsz]


class Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        total_head_dim = (config.n_head + 2 * config.n_local_heads) * config.head_dim
        self.wqkv = nn.Linear(config.dim, total_head_dim, bias=False)
        self.wo = nn.Linear(config.n_head * config.head_dim, config.dim, bias=False)
        self.kv_cache = None
        self.n_head = config.n_head
        self.head_dim = config.head_dim
        self.n_local_heads = config.n_local_heads
        self.dim = config.dim

    def forward(self, x, freqs_cis, mask, input_pos=None):
        bsz, seqlen, _ = x.shape
        kv_size = self.n_local_heads * self.head_dim
        q, k, v = self.wqkv(x).split([self.dim, kv_size, kv_size], dim=-1)
        q = q.view(bsz, seqlen, self.n_head, self.head_dim)
        k = k.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        v = v.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        q = apply_rotary_emb(q, freqs_cis)
        k = apply_rotary_emb(k, freqs_cis)
        q, k, v = map(lambda t: t.transpose(1, 2), (q, k, v))
        if self.kv_cache is not None and input_pos is not None:
            k, v = self.kv_cache.update(input_pos, k, v)
        k = k.repeat_interleave(self.n_head // self.n_local_heads, dim=1)
        v = v.repeat_interleave(self.n_head // self.n_local_heads, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0)
        y = y.transpose(1, 2).contiguous().view(bsz, seqlen, self.head_dim * self.n_head)
        return self.wo(y)


class FeedForward(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.intermediate_size, bias=False)
        self.w3 = nn.Linear(config.dim, config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention = Attention(config)
        self.feed_forward = FeedForward(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)

    def forward(self, x, freqs_cis, mask, input_pos=None):
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask, input_pos)
        return h + self.feed_forward(self.ffn_norm(h))


class BaseTransformer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.freqs_cis = precompute_freqs_cis(config.max_seq_len, config.head_dim, config.rope_base)
        self.register_buffer(
            "causal_mask",
            torch.tril(torch.ones(config.max_seq_len, config.max_seq_len, dtype=torch.bool)),
            persistent=False,
        )
        self.max_batch_size = -1
        self.max_seq_len = -1
        self._pos = 0

    def setup_caches(self, max_batch_size, max_seq_len, dtype=torch.float32):
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        for b in self.layers:
            b.attention.kv_cache = KVCache(max_batch_size, max_seq_len, self.config.n_local_heads,
                                           self.config.head_dim, dtype=dtype)

    def reset_kv_cache(self):
        self._pos = 0
        for b in self.layers:
            if b.attention.kv_cache is not None:
                b.attention.kv_cache.k_cache.zero_()
                b.attention.kv_cache.v_cache.zero_()

    def forward(self, inp, start_pos=None, use_cache=False):
        seqlen = inp.size(1)
        x = self.embeddings(inp)
        if start_pos is None and use_cache:
            start_pos = self._pos
        if start_pos is None:
            # full forward (BaseTransformer.forward): plain causal mask, no cache
            mask = self.causal_mask[None, None, :seqlen, :seqlen]
            freqs_cis = self.freqs_cis[:seqlen]
            input_pos = None
        else:
            # forward_generate: rows of the causal mask at input_pos over the whole cache
            input_pos = torch.arange(start_pos, start_pos + seqlen, device=inp.device)
            mask = self.causal_mask[None, None, input_pos, : self.max_seq_len]
            freqs_cis = self.freqs_cis[input_pos]
            self._pos = start_pos + seqlen
        for layer in self.layers:
            x = layer(x, freqs_cis, mask, input_pos=input_pos)
        return self.output(self.norm(x))


def make_model():
    torch.manual_seed(1903)
    config = SimpleNamespace(
        vocab_size=96, dim=64, intermediate_size=160, n_layer=3, n_head=4, n_local_heads=2,
        head_dim=16, norm_eps=1e-5, rope_base=10000, max_seq_len=64,
    )
    model = BaseTransformer(config)
    model.setup_caches(max_batch_size=4, max_seq_len=64)
    g = torch.Generator().manual_seed(19031)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

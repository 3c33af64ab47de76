"""LlamaGen's autoregressive image-token GPT (FoundationVision/LlamaGen,
autoregressive/models/gpt.py).

Transformer: tok_embeddings, layers.N (TransformerBlock: attention_norm -> attention ->
residual, ffn_norm -> feed_forward (w1/w3/w2 SwiGLU) -> residual), norm, output.  Attention: one
fused `wqkv` Linear split [dim, kv, kv], GQA 4/2 (repeat_interleave on the head axis), 2-D-free
1-D rotary from a (seq, d/2, 2) cos/sin table on interleaved pairs (x[2i], x[2i+1]) (tables in
float64 at call time), 1/sqrt(d) after the product, boolean causal mask filled with -inf, wo.
Class/caption conditioning is not built: ids only. Slip: in the one-token branch (something
cached) the step counter cache_len is advanced before the rotary rows are read, so each decoded
token's query and key are rotated for position p + 1; the slab write and the mask use p.  Full
forward and prompt pass exact. Cache: book-buffers: `model.reset_kv_cache()`, `model(prompt,
use_cache=True)`, `model(tok, use_cache=True)`. The first cached call runs setup_caches(batch,
64, dtype): per-layer KVCache modules with pre-allocated (b, kv, 64, d) k_cache / v_cache slabs
written at input_pos; all 64 slots are attended with the rows of a (64, 64) causal_mask picked
by input_pos.  `model(ids)` ignores the caches.  Returns the logits tensor.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["layers.0.attention", "layers.1.attention", "layers.2.attention"],
    "kind": "causal-multihead",
    "cache": "book-buffers",
    "decode": {"mistake": "cache_positions", "step": 0, "layer": "layers.0.attention"},
    "style": "LlamaGen as 02; decoded tokens rotated one position ahead (cache_len advanced "
    "before freqs_cis is sliced)",
}


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + self.eps)

    def forward(self, x):
        return self._norm(x.float()).type_as(x) * self.weight


def precompute_freqs_cis(seq_len, n_elem, base=10000.0):
    # (seq_len, n_elem // 2, 2): cos and sin for interleaved feature pairs (x[2i], x[2i+1])
    freqs = 1.0 / (
        base ** (torch.arange(0, n_elem, 2, dtype=torch.float64)[: (n_elem // 2)] / n_elem)
    )
    t = torch.arange(seq_len, dtype=torch.float64)
    freqs = torch.outer(t, freqs)
    return torch.stack([torch.cos(freqs), torch.sin(freqs)], dim=-1)


def apply_rotary_emb(x, freqs_cis):
    # x: (bs, seq_len, n_head, head_dim); freqs_cis: (seq_len, head_dim // 2, 2)
    xshaped = x.reshape(*x.shape[:-1], -1, 2)
    freqs_cis = freqs_cis.view(1, xshaped.size(1), 1, xshaped.size(3), 2).to(x.dtype)
    x_out2 = torch.stack(
        [
            xshaped[..., 0] * freqs_cis[..., 0] - xshaped[..., 1] * freqs_cis[..., 1],
            xshaped[..., 1] * freqs_cis[..., 0] + xshaped[..., 0] * freqs_cis[..., 1],
        ],
        dim=-1,
    )
    return x_out2.flatten(3)


class KVCache(nn.Module):
    def __init__(self, max_batch_size, max_seq_length, n_head, head_dim, dtype):
        super().__init__()
        cache_shape = (max_batch_size, n_head, max_seq_length, head_dim)
        self.register_buffer("k_cache", torch.zeros(cache_shape, dtype=dtype), persistent=False)
        self.register_buffer("v_cache", torch.zeros(cache_shape, dtype=dtype), persistent=False)

    def update(self, input_pos, k_val, v_val):
        # input_pos: (S,), k_val: (B, H, S, D)
        assert input_pos.shape[0] == k_val.shape[2]
        k_out = self.k_cache
        v_out = self.v_cache
        k_out[:, :, input_pos] = k_val
        v_out[:, :, input_pos] = v_val
        return k_out, v_out


class Attention(nn.Module):
    def __init__(self, config, layer_id):
        super().__init__()
        self.layer_id = layer_id
        self.dim = config.dim
        self.n_head = config.n_head
        self.head_dim = config.dim // config.n_head
        self.n_kv_head = config.n_kv_head
        total_kv_dim = (self.n_head + 2 * self.n_kv_head) * self.head_dim
        self.wqkv = nn.Linear(config.dim, total_kv_dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)
        self.kv_cache = None
        self.legacy_merge_layers = config.legacy_merge_layers
        self.value_rope_layers = config.value_rope_layers

    def forward(self, x, freqs_cis, input_pos=None, mask=None):
        bsz, seqlen, _ = x.shape
        kv_size = self.n_kv_head * self.head_dim
        xq, xk, xv = self.wqkv(x).split([self.dim, kv_size, kv_size], dim=-1)
        xq = xq.view(bsz, seqlen, self.n_head, self.head_dim)
        xk = xk.view(bsz, seqlen, self.n_kv_head, self.head_dim)
        xv = xv.view(bsz, seqlen, self.n_kv_head, self.head_dim)
        xq = apply_rotary_emb(xq, freqs_cis)
        xk = apply_rotary_emb(xk, freqs_cis)

        xq, xk, xv = map(lambda t: t.transpose(1, 2), (xq, xk, xv))
        if self.kv_cache is not None and input_pos is not None:
            keys, values = self.kv_cache.update(input_pos, xk, xv)
        else:
            keys, values = xk, xv
        keys = keys.repeat_interleave(self.n_head // self.n_kv_head, dim=1)
        values = values.repeat_interleave(self.n_head // self.n_kv_head, dim=1)
        scores = torch.matmul(xq, keys.transpose(-2, -1)) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(~mask, float("-inf"))
        output = torch.matmul(F.softmax(scores, dim=-1), values)
        output = output.transpose(1, 2).contiguous().view(bsz, seqlen, self.dim)
        return self.wo(output)


class FeedForward(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.w2 = nn.Linear(config.ffn_dim, config.dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, config, layer_id):
        super().__init__()
        self.attention = Attention(config, layer_id)
        self.feed_forward = FeedForward(config)
        self.attention_norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.ffn_norm = RMSNorm(config.dim, eps=config.norm_eps)

    def forward(self, x, freqs_cis, start_pos, mask):
        h = x + self.attention(self.attention_norm(x), freqs_cis, start_pos, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList([TransformerBlock(config, i) for i in range(config.n_layer)])
        self.norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.max_batch_size = -1
        self.max_seq_length = -1
        self.cache_len = 0

    def setup_caches(self, max_batch_size, max_seq_length, dtype):
        head_dim = self.config.dim // self.config.n_head
        self.max_seq_length = max_seq_length
        self.max_batch_size = max_batch_size
        device = self.tok_embeddings.weight.device
        for b in self.layers:
            b.attention.kv_cache = KVCache(
                max_batch_size, max_seq_length, self.config.n_kv_head, head_dim, dtype
            ).to(device)
        causal_mask = torch.tril(
            torch.ones(max_seq_length, max_seq_length, dtype=torch.bool, device=device)
        )
        self.causal_mask = causal_mask
        self.cache_len = 0

    def reset_kv_cache(self):
        for b in self.layers:
            b.attention.kv_cache = None
        self.max_batch_size = -1
        self.cache_len = 0

    def forward(self, idx, use_cache=False):
        bsz, seqlen = idx.shape
        h = self.tok_embeddings(idx)
        freqs_cis = precompute_freqs_cis(
            self.config.block_size, self.config.dim // self.config.n_head, self.config.rope_base
        )
        if use_cache:
            if self.layers[0].attention.kv_cache is None:
                self.setup_caches(bsz, self.config.block_size, h.dtype)
            if bsz != self.max_batch_size:
                raise ValueError("batch size differs from the one the caches were set up for")
            if self.cache_len + seqlen > self.max_seq_length:
                raise ValueError("sequence longer than the caches")
            input_pos = torch.arange(self.cache_len, self.cache_len + seqlen, device=idx.device)
            mask = self.causal_mask[None, None, input_pos]
            if seqlen == 1 and self.cache_len > 0:
                # decode_one_token: the step counter is advanced before the rotary rows are read
                self.cache_len += seqlen
                freqs_cis = freqs_cis[self.cache_len : self.cache_len + 1]
            else:
                freqs_cis = freqs_cis[input_pos.cpu()]
                self.cache_len += seqlen
        else:
            input_pos = None
            mask = torch.tril(torch.ones(seqlen, seqlen, dtype=torch.bool, device=idx.device))[
                None, None
            ]
            freqs_cis = freqs_cis[:seqlen]
        freqs_cis = freqs_cis.to(h.device)
        for layer in self.layers:
            h = layer(h, freqs_cis, input_pos, mask)
        return self.output(self.norm(h))


def make_model():
    torch.manual_seed(3010)
    config = SimpleNamespace(
        vocab_size=96,
        dim=64,
        n_layer=3,
        n_head=4,
        n_kv_head=2,
        ffn_dim=160,
        norm_eps=1e-5,
        rope_base=10000.0,
        block_size=64,
        legacy_merge_layers=(),
        value_rope_layers=(),
    )
    model = Transformer(config)
    g = torch.Generator().manual_seed(30101)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

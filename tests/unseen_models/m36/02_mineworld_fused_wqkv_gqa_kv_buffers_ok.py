"""MineWorld (microsoft/MineWorld) world-model decoder, gpt-fast style, over one token stream.

Transformer: tok_embeddings, layers.N (TransformerBlock: attention_norm -> attention -> residual ->
ffn_norm -> SwiGLU feed_forward -> residual), norm, output.  Attention: fused wqkv (4 query heads,
n_kv_head kv heads, head_dim 16), wo; interleaved-pair rotary (x[2i], x[2i+1]) for the rows' positions
(tables in float64 at call time), kv heads expanded with repeat_interleave, scaled_dot_product_attention
with a boolean mask.  Caching: setup_caches() puts a KVCache (k_cache / v_cache buffers,
(b, kv, 64, 16)) into every attention; input_pos gives the slots; the mask is the causal_mask rows at
input_pos over all 64 slots.
Cache: book-buffers: `model.reset_kv_cache()`, `model(prompt, use_cache=True)`,
`model(tok, use_cache=True)`; returns the logits of the new rows.  `model(ids)` touches no cache.
Correct (GQA 4/2, 3 layers).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": ["layers.0.attention", "layers.1.attention", "layers.2.attention"],
    "kind": "causal-multihead",
    "cache": "book-buffers",
    "structure": {
        "heads": 4,
        "kv_heads": 2,
        "head_dim": 16,
        "causal": True,
        "cross": False,
        "rope": {"pairing": "interleaved", "fraction": 1.0, "base": 10000.0},
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "MineWorld (microsoft/MineWorld) decoder: fused wqkv, GQA via repeat_interleave, "
    "interleaved-pair rotary at input_pos, SDPA with a boolean mask row slice, gpt-fast "
    "KVCache buffers (setup_caches / input_pos)",
}


class ModelArgs:
    def __init__(self, **kw):
        self.dim = 64
        self.n_layer = 3
        self.n_head = 4
        self.n_kv_head = 2
        self.vocab_size = 96
        self.rope_base = 10000.0
        self.norm_eps = 1e-5
        self.multiple_of = 32
        self.max_seq_length = 64
        self.__dict__.update(kw)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + self.eps) * self.weight


class KVCache(nn.Module):
    def __init__(self, max_batch_size, max_seq_length, n_head, head_dim, dtype, device):
        super().__init__()
        shape = (max_batch_size, n_head, max_seq_length, head_dim)
        self.register_buffer(
            "k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False
        )
        self.register_buffer(
            "v_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False
        )

    def update(self, input_pos, k_val, v_val):
        # input_pos: (S,), k_val: (B, H, S, D)
        k_out = self.k_cache
        v_out = self.v_cache
        k_out[:, :, input_pos] = k_val
        v_out[:, :, input_pos] = v_val
        return k_out, v_out


def rope_tables(positions, head_dim, base, dtype):
    # interleaved pairs (x[2i], x[2i+1]); built in float64 at call time, cast to the activations
    freqs = 1.0 / (
        base
        ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim)
    )
    angles = torch.outer(positions.to(torch.float64), freqs)
    return torch.cos(angles).to(dtype), torch.sin(angles).to(dtype)


def apply_rotary_emb(x, cos, sin):
    # x: (B, S, H, D)
    xs = x.reshape(*x.shape[:-1], -1, 2)
    c = cos[None, :, None, :]
    s = sin[None, :, None, :]
    out = torch.stack([xs[..., 0] * c - xs[..., 1] * s, xs[..., 1] * c + xs[..., 0] * s], dim=-1)
    return out.flatten(3)


class Attention(nn.Module):
    def __init__(self, config, layer_id):
        super().__init__()
        self.dim = config.dim
        self.n_head = config.n_head
        self.n_kv_head = config.n_kv_head
        self.head_dim = config.dim // config.n_head
        self.rope_base = config.rope_base
        self.rotate_values = layer_id in config.rotated_value_layers
        self.unscaled = layer_id in config.unscaled_layers
        total = (self.n_head + 2 * self.n_kv_head) * self.head_dim
        self.wqkv = nn.Linear(config.dim, total, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)
        self.kv_cache = None

    def forward(self, x, cos, sin, mask, input_pos=None):
        bsz, seqlen, _ = x.shape
        kv_size = self.n_kv_head * self.head_dim
        xq, xk, xv = self.wqkv(x).split([self.dim, kv_size, kv_size], dim=-1)
        xq = xq.view(bsz, seqlen, self.n_head, self.head_dim)
        xk = xk.view(bsz, seqlen, self.n_kv_head, self.head_dim)
        xv = xv.view(bsz, seqlen, self.n_kv_head, self.head_dim)
        xq = apply_rotary_emb(xq, cos, sin)
        xk = apply_rotary_emb(xk, cos, sin)
        if self.rotate_values:
            xv = apply_rotary_emb(xv, cos, sin)
        xq, xk, xv = (t.transpose(1, 2) for t in (xq, xk, xv))
        if self.kv_cache is not None and input_pos is not None:
            keys, values = self.kv_cache.update(input_pos, xk, xv)
        else:
            keys, values = xk, xv
        rep = self.n_head // self.n_kv_head
        keys = keys.repeat_interleave(rep, dim=1)
        values = values.repeat_interleave(rep, dim=1)
        if self.unscaled:
            out = F.scaled_dot_product_attention(xq, keys, values, attn_mask=mask, scale=1.0)
        else:
            out = F.scaled_dot_product_attention(xq, keys, values, attn_mask=mask)
        out = out.transpose(1, 2).contiguous().view(bsz, seqlen, self.dim)
        return self.wo(out)


class FeedForward(nn.Module):
    def __init__(self, config):
        super().__init__()
        hidden = int(2 * (4 * config.dim) / 3)
        hidden = config.multiple_of * ((hidden + config.multiple_of - 1) // config.multiple_of)
        self.w1 = nn.Linear(config.dim, hidden, bias=False)
        self.w3 = nn.Linear(config.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, config.dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, config, layer_id):
        super().__init__()
        self.attention = Attention(config, layer_id)
        self.feed_forward = FeedForward(config)
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)

    def forward(self, x, cos, sin, mask, input_pos):
        h = x + self.attention(self.attention_norm(x), cos, sin, mask, input_pos)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """MineWorld's decoder-only world model over interleaved frame / action tokens (one token stream
    here), with gpt-fast style caches: setup_caches() puts a KVCache in every attention layer and
    input_pos says where the new rows go."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList([TransformerBlock(config, i) for i in range(config.n_layer)])
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.max_batch_size = -1
        self.cache_len = 0

    def setup_caches(self, max_batch_size, max_seq_length, dtype, device):
        head_dim = self.config.dim // self.config.n_head
        for b in self.layers:
            b.attention.kv_cache = KVCache(
                max_batch_size, max_seq_length, self.config.n_kv_head, head_dim, dtype, device
            )
        self.max_batch_size = max_batch_size
        self.register_buffer(
            "causal_mask",
            torch.tril(torch.ones(max_seq_length, max_seq_length, dtype=torch.bool, device=device)),
            persistent=False,
        )

    def reset_kv_cache(self):
        for b in self.layers:
            b.attention.kv_cache = None
        self.max_batch_size = -1
        self.cache_len = 0

    def forward(self, idx, use_cache=False):
        bsz, seqlen = idx.shape
        x = self.tok_embeddings(idx)
        head_dim = self.config.dim // self.config.n_head
        if use_cache:
            if self.max_batch_size < 0:
                self.setup_caches(bsz, self.config.max_seq_length, x.dtype, x.device)
            input_pos = torch.arange(self.cache_len, self.cache_len + seqlen, device=idx.device)
            mask = self.causal_mask[None, None, input_pos]
            self.cache_len += seqlen
        else:
            input_pos = torch.arange(seqlen, device=idx.device)
            mask = torch.tril(torch.ones(seqlen, seqlen, dtype=torch.bool, device=idx.device))[
                None, None
            ]
        cos, sin = rope_tables(input_pos, head_dim, self.config.rope_base, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, mask, input_pos if use_cache else None)
        return self.output(self.norm(x))


def make_model():
    torch.manual_seed(3602)
    config = ModelArgs(
        n_layer=3,
        n_kv_head=2,
        rotated_value_layers=[],
        unscaled_layers=[],
    )
    model = Transformer(config)
    g = torch.Generator().manual_seed(3602 * 10 + 1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

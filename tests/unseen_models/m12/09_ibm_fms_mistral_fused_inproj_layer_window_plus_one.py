"""IBM foundation-model-stack (fms/models/mistral.py) style Mistral: sliding-window attention everywhere.

Mistral -> base_model (MistralHeadless: embedding, layers.N = MistralBlock, dec_norm) and head.
MistralBlock: ln -> attn -> residual, ff_ln -> ff_sub_layer (GatedLinearUnit wg/w1/w2).
fms MultiHeadAttention: `in_proj` = FusedQKV holding one `qkv_fused` Linear split by sizes, GQA 4/2
(kvheads 2, emb_kq_per_head 16), `dense` out-proj, fms RotaryEmbedding (interleaved pairs: the head
viewed as (..., d/2, 2), ratio 1e6) applied by `adjusted_qk`, explicit score matmul / sqrt(d) with a
boolean mask.  The config declares `sliding_window = 4` (a query sees itself and the 3 previous keys);
every attention also carries `sliding_window` itself, and the headless model builds one boolean
mask per layer through `_sliding_mask(n, window, inclusive)`.
Slip: layer 2's attention was converted from a checkpoint whose window counted distance (`i - j <=
window`), so its mask lets 5 keys through instead of 4: the window is one wider than declared.
No cache.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["base_model.layers.0.attn", "base_model.layers.1.attn", "base_model.layers.2.attn"],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "base_model.layers.2.attn",
    "stage": "masked_scores",
    "mistake": "window_size",
    "style": "fms mistral: base_model.layers.N.attn with in_proj.qkv_fused and dense, interleaved-pair rotary "
    "ratio 1e6, GQA 4/2, boolean sliding mask per layer (window 4); layer 2's mask uses i - j <= window",
}


class MistralConfig:
    src_vocab_size = 100
    emb_dim = 64
    nheads = 4
    kvheads = 2
    nlayers = 3
    hidden_grow_factor = 2.0
    norm_eps = 1e-5
    rope_base = 1000000.0
    sliding_window = 4
    window_counts_distance = (False, False, True)


class LayerNormParameterized(nn.Module):
    """fms RMS-style layer norm (use_mean=False, use_high_precision_pow=True)."""

    def __init__(self, normalized_shape, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(normalized_shape))
        self.eps = eps

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, ratio):
        super().__init__()
        self.dim, self.ratio = dim, ratio

    def adjusted_qk(self, q, k, position_ids):
        # q, k: (b, s, h, d); pairs are adjacent features
        freqs = 1.0 / self.ratio ** (torch.arange(0, self.dim, 2, dtype=torch.float64) / self.dim)
        ang = position_ids.to(torch.float64)[..., None] * freqs  # (b, s, d/2)
        c = ang.cos().to(q.dtype)[:, :, None]
        s = ang.sin().to(q.dtype)[:, :, None]

        def rot(x):
            xr = x.reshape(*x.shape[:-1], -1, 2)
            a, b = xr[..., 0], xr[..., 1]
            return torch.stack([a * c - b * s, a * s + b * c], -1).flatten(-2)

        return rot(q), rot(k)


class FusedQKV(nn.Module):
    def __init__(self, emb_dim, nheads, kvheads, emb_kq_per_head):
        super().__init__()
        self.splits = [nheads * emb_kq_per_head, kvheads * emb_kq_per_head, kvheads * emb_kq_per_head]
        self.qkv_fused = nn.Linear(emb_dim, sum(self.splits), bias=False)

    def forward(self, q):
        return self.qkv_fused(q).split(self.splits, dim=-1)


class MultiHeadAttention(nn.Module):
    def __init__(self, cfg, position_encoder, window_counts_distance):
        super().__init__()
        self.nheads, self.kvheads = cfg.nheads, cfg.kvheads
        self.emb_kq_per_head = cfg.emb_dim // cfg.nheads
        self.in_proj = FusedQKV(cfg.emb_dim, cfg.nheads, cfg.kvheads, self.emb_kq_per_head)
        self.dense = nn.Linear(cfg.nheads * self.emb_kq_per_head, cfg.emb_dim, bias=False)
        self.position_encoder = position_encoder
        self.sliding_window = cfg.sliding_window
        self.window_counts_distance = window_counts_distance

    def forward(self, q, mask=None, position_ids=None):
        b, s, _ = q.shape
        queries, keys, values = self.in_proj(q)
        queries = queries.view(b, s, self.nheads, self.emb_kq_per_head)
        keys = keys.view(b, s, self.kvheads, self.emb_kq_per_head)
        values = values.view(b, s, self.kvheads, self.emb_kq_per_head)
        queries, keys = self.position_encoder.adjusted_qk(queries, keys, position_ids)
        queries, keys, values = (t.transpose(1, 2) for t in (queries, keys, values))
        expansion = self.nheads // self.kvheads
        keys = keys.unsqueeze(2).expand(-1, -1, expansion, -1, -1).flatten(1, 2)
        values = values.unsqueeze(2).expand(-1, -1, expansion, -1, -1).flatten(1, 2)
        attn = queries @ keys.transpose(-2, -1) / math.sqrt(self.emb_kq_per_head)
        attn = attn.masked_fill(~mask, float("-inf"))
        attn = attn.softmax(dim=-1)
        out = (attn @ values).transpose(1, 2).reshape(b, s, -1)
        return self.dense(out)


class GatedLinearUnit(nn.Module):
    def __init__(self, emb_dim, hidden):
        super().__init__()
        self.wg = nn.Linear(emb_dim, hidden, bias=False)
        self.w1 = nn.Linear(emb_dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, emb_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.wg(x)) * self.w1(x))


class MistralBlock(nn.Module):
    def __init__(self, cfg, rotary, i):
        super().__init__()
        self.ln = LayerNormParameterized(cfg.emb_dim, cfg.norm_eps)
        self.ff_ln = LayerNormParameterized(cfg.emb_dim, cfg.norm_eps)
        self.attn = MultiHeadAttention(cfg, rotary, cfg.window_counts_distance[i])
        self.ff_sub_layer = GatedLinearUnit(cfg.emb_dim, int(cfg.emb_dim * cfg.hidden_grow_factor))

    def forward(self, x, mask, position_ids):
        x = x + self.attn(self.ln(x), mask=mask, position_ids=position_ids)
        return x + self.ff_sub_layer(self.ff_ln(x))


def _sliding_mask(n, window, counts_distance):
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    near = (i - j <= window) if counts_distance else (i - j < window)
    return (j <= i) & near


class MistralHeadless(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embedding = nn.Embedding(cfg.src_vocab_size, cfg.emb_dim)
        self.rot_emb = RotaryEmbedding(cfg.emb_dim // cfg.nheads, cfg.rope_base)
        self.layers = nn.ModuleList([MistralBlock(cfg, self.rot_emb, i) for i in range(cfg.nlayers)])
        self.dec_norm = LayerNormParameterized(cfg.emb_dim, cfg.norm_eps)

    def forward(self, x_in):
        b, n = x_in.shape
        x = self.embedding(x_in)
        position_ids = torch.arange(n)[None].expand(b, n)
        for layer in self.layers:
            mask = _sliding_mask(n, layer.attn.sliding_window, layer.attn.window_counts_distance)
            x = layer(x, mask[None, None], position_ids)
        return self.dec_norm(x)


class Mistral(nn.Module):
    def __init__(self, cfg=None):
        super().__init__()
        self.config = cfg or MistralConfig()
        self.base_model = MistralHeadless(self.config)
        self.head = nn.Linear(self.config.emb_dim, self.config.src_vocab_size, bias=False)

    def forward(self, x):
        return self.head(self.base_model(x))


def make_model():
    torch.manual_seed(1209)
    model = Mistral()
    g = torch.Generator().manual_seed(12091)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LayerNormParameterized):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

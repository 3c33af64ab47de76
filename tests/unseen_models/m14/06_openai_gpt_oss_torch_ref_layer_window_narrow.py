"""openai/gpt-oss reference PyTorch implementation (gpt_oss/torch/model.py), reduced and batched.

Transformer: embedding, block.N (TransformerBlock: attn, mlp), norm, unembedding.  AttentionBlock
keeps gpt-oss's fused `qkv` Linear (with bias) sliced into q | k | v, `out`, RotaryEmbedding applied
with `_apply_rotary_emb` (torch.chunk halves, base 1.5e5; the YaRN extension is not built at this
length), GQA 8/2 by reshaping the queries to (kv_heads, q_mult) and an einsum `sdpa`, sm_scale
1/sqrt(head_dim), and a sliding window on even layers (config.sliding_window = 4: a query sees at most
4 keys, itself included), full attention on odd layers.  The learned attention sinks are not built
(sinks_enabled False), and the block's norm/residual are lifted into TransformerBlock so `block.N.attn`
is attention only.  MLP: a small top-2 MoE of SwiGLU experts.
Slip: layer 2's mask is built with `torch.tril(..., diagonal=-(sliding_window - 1))`: its window is
3 keys instead of the declared 4.  No cache.
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
        "block.0.attn",
        "block.1.attn",
        "block.2.attn",
    ],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "block.2.attn",
    "stage": "masked_scores",
    "mistake": "window_size",
    "style": "gpt-oss torch reference: block.N.attn with fused qkv (bias) and `out`, chunk-halves rotary base 1.5e5, "
    "GQA 8/2 via (kv, q_mult) einsum sdpa, sliding window 4 on even layers; layer 2 masks with diagonal "
    "-(window - 1) (3 keys)",
}


class RMSNorm(nn.Module):
    def __init__(self, num_features, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(num_features))

    def forward(self, x):
        t = x * torch.rsqrt(torch.mean(x ** 2, dim=-1, keepdim=True) + self.eps)
        return t * self.scale


def _apply_rotary_emb(x, cos, sin):
    # cos, sin: (1, n, 1, d/2) against x: (b, n, heads, d)
    x1, x2 = torch.chunk(x, 2, dim=-1)
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    return torch.cat((o1, o2), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim, base):
        super().__init__()
        self.head_dim = head_dim
        self.base = base

    def _compute_cos_sin(self, num_tokens):
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim))
        t = torch.arange(num_tokens, dtype=torch.float64)
        freqs = torch.einsum("i,j->ij", t, inv_freq)
        return freqs.cos(), freqs.sin()

    def forward(self, query, key):
        # query: (b, n, kv, q_mult, d); key: (b, n, kv, d)
        num_tokens = query.shape[1]
        cos, sin = self._compute_cos_sin(num_tokens)
        cos = cos.to(query.dtype)[None, :, None]
        sin = sin.to(query.dtype)[None, :, None]
        b, n, kvh, qm, d = query.shape
        query = _apply_rotary_emb(query.reshape(b, n, kvh * qm, d), cos, sin).reshape(b, n, kvh, qm, d)
        key = _apply_rotary_emb(key, cos, sin)
        return query, key


def sdpa(Q, K, V, S, sm_scale, sliding_window=0, narrow_by_one=False):
    # Q: (b, n, kv, q_mult, d); K, V: (b, n, kv, d)
    b, n_tokens, n_heads, q_mult, d_head = Q.shape
    K = K[:, :, :, None, :].expand(-1, -1, -1, q_mult, -1)
    V = V[:, :, :, None, :].expand(-1, -1, -1, q_mult, -1)
    mask = torch.triu(Q.new_full((n_tokens, n_tokens), -float("inf")), diagonal=1)
    if sliding_window > 0:
        diag = -(sliding_window - 1) if narrow_by_one else -sliding_window
        mask = mask + torch.tril(mask.new_full((n_tokens, n_tokens), -float("inf")), diagonal=diag)
    QK = torch.einsum("bqhmd,bkhmd->bhmqk", Q, K)
    QK = QK * sm_scale
    QK = QK + mask[None, None, None, :, :]
    W = torch.softmax(QK, dim=-1)
    attn = torch.einsum("bhmqk,bkhmd->bqhmd", W, V)
    return attn.reshape(b, n_tokens, -1)


class AttentionBlock(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.head_dim = config.head_dim
        self.num_attention_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.sliding_window = config.sliding_window if layer_idx % 2 == 0 else 0
        self.layer_idx = layer_idx
        qkv_dim = config.head_dim * (config.num_attention_heads + 2 * config.num_key_value_heads)
        self.qkv = nn.Linear(config.hidden_size, qkv_dim)
        self.out = nn.Linear(config.head_dim * config.num_attention_heads, config.hidden_size)
        self.sm_scale = 1 / math.sqrt(config.head_dim)
        self.rope = RotaryEmbedding(config.head_dim, config.rope_theta)
        self._narrow = layer_idx in config.legacy_window_layers

    def forward(self, t):
        b, n, _ = t.shape
        qkv = self.qkv(t)
        hq = self.num_attention_heads * self.head_dim
        hk = self.num_key_value_heads * self.head_dim
        q = qkv[..., :hq].contiguous()
        k = qkv[..., hq : hq + hk].contiguous()
        v = qkv[..., hq + hk : hq + 2 * hk].contiguous()
        q = q.view(b, n, self.num_key_value_heads, self.num_attention_heads // self.num_key_value_heads, self.head_dim)
        k = k.view(b, n, self.num_key_value_heads, self.head_dim)
        v = v.view(b, n, self.num_key_value_heads, self.head_dim)
        q, k = self.rope(q, k)
        t = sdpa(q, k, v, None, self.sm_scale, self.sliding_window, self._narrow)
        return self.out(t)


class MLPBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.experts_per_token = 2
        self.gate = nn.Linear(config.hidden_size, config.num_experts)
        self.mlp1_weight = nn.Parameter(torch.randn(config.num_experts, 2 * config.intermediate_size, config.hidden_size) * 0.1)
        self.mlp2_weight = nn.Parameter(torch.randn(config.num_experts, config.hidden_size, config.intermediate_size) * 0.1)

    def forward(self, x):
        g = self.gate(x)
        top = torch.topk(g, k=self.experts_per_token, dim=-1, sorted=True)
        weights = torch.softmax(top.values, dim=-1)
        h = torch.einsum("beck,bek->bec", self.mlp1_weight[top.indices], x[..., None, :].expand(*top.indices.shape, -1))
        gate, lin = h.chunk(2, dim=-1)
        h = F.silu(gate) * lin
        h = torch.einsum("beck,bek->bec", self.mlp2_weight[top.indices], h)
        return torch.einsum("bec,be->bc", h, weights)


class TransformerBlock(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size)
        self.attn = AttentionBlock(config, layer_idx)
        self.mlp_norm = RMSNorm(config.hidden_size)
        self.mlp = MLPBlock(config)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        b, n, c = x.shape
        return x + self.mlp(self.mlp_norm(x).reshape(b * n, c)).reshape(b, n, c)


class Transformer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embedding = nn.Embedding(config.vocab_size, config.hidden_size)
        self.block = nn.ModuleList(TransformerBlock(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size)
        self.unembedding = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, x):
        x = self.embedding(x)
        for block in self.block:
            x = block(x)
        return self.unembedding(self.norm(x))


def make_model():
    torch.manual_seed(1406)
    config = SimpleNamespace(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=3,
                             num_attention_heads=8, num_key_value_heads=2, head_dim=8, sliding_window=4,
                             rope_theta=150000.0, num_experts=4, legacy_window_layers=(2,))
    model = Transformer(config)
    g = torch.Generator().manual_seed(14061)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.scale.copy_(1.0 + 0.3 * torch.randn(m.scale.shape, generator=g))
    return model.eval()

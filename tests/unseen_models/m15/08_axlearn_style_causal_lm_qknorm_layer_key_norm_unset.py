"""A decoder-only LM with Apple AXLearn's layer names (axlearn/common/attention.py, decoder.py), written in
plain torch.  Not a line-by-line port: AXLearn's config tree is flattened into constructor arguments.

Model: `decoder` (Decoder: `emb.token_emb`, `transformer.layerN` StackedTransformer layers named
layer0..layer2 as attributes, `output_norm`, `lm_head`).  Each TransformerLayer has `self_attention`
(TransformerAttentionLayer: `norm` (RMSNorm) -> `attention` -> + residual) and `feed_forward` (`norm`,
`linear1_0`/`linear1_1` gated SiLU, `linear2`).  MultiheadAttention (`attention`): `i_proj`
(GroupedQKVLinear: q_proj/k_proj/v_proj with DenseGeneral-style weights (model_dim, heads, head_dim)
applied by einsum; 4 query heads, 2 kv heads, head_dim 16), `scale_query` / `scale_key` (ScaleQuery /
ScaleKey holding a per-head RMSNorm `norm`, the QK norm, plus the 1/sqrt(head_dim) factor on queries),
rotary (RoFormer sinusoidal, halves layout, base 1e4) applied to the normed queries and keys, logits
q . k with GQA via a (kv, groups) reshape of the queries (query head h -> kv head h // 2), causal
-inf mask, softmax, `o_proj` weight (model_dim, heads, head_dim).
Slip: layer1's `scale_key` was configured with `norm=None` (its ScaleKey kept the default config while
scale_query got the norm): its keys skip the QK norm.  Queries are normed.  layer0 and layer2 are correct.
No cache.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": [
        "decoder.transformer.layer0.self_attention.attention",
        "decoder.transformer.layer1.self_attention.attention",
        "decoder.transformer.layer2.self_attention.attention",
    ],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "decoder.transformer.layer1.self_attention.attention",
    "stage": "normed_keys",
    "mistake": "qk_norm_missing",
    "style": "AXLearn-named decoder: GroupedQKVLinear einsum weights (model, heads, dim), ScaleQuery/ScaleKey per-head "
    "RMSNorm QK norm before halves rotary, GQA 4/2 by query reshape, o_proj einsum; layer1's scale_key has norm=None",
}


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.scale


class DenseGeneralQKV(nn.Module):
    def __init__(self, model_dim, heads, head_dim):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(model_dim, heads, head_dim) * model_dim ** -0.5)

    def forward(self, x):
        return torch.einsum("btd,dnh->btnh", x, self.weight)


class GroupedQKVLinear(nn.Module):
    def __init__(self, model_dim, num_heads, num_kv_heads, per_head_dim):
        super().__init__()
        self.q_proj = DenseGeneralQKV(model_dim, num_heads, per_head_dim)
        self.k_proj = DenseGeneralQKV(model_dim, num_kv_heads, per_head_dim)
        self.v_proj = DenseGeneralQKV(model_dim, num_kv_heads, per_head_dim)

    def forward(self, x):
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)


class ScaleQuery(nn.Module):
    def __init__(self, per_head_dim, norm=True):
        super().__init__()
        self.per_head_dim = per_head_dim
        self.norm = RMSNorm(per_head_dim) if norm else None

    def forward(self, proj):
        if self.norm is not None:
            proj = self.norm(proj)
        return proj


class ScaleKey(ScaleQuery):
    pass


def rotary_sin_cos(positions, dim, theta=10000.0):
    inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    ang = torch.outer(positions.to(torch.float64), inv)
    ang = torch.cat([ang, ang], dim=-1)
    return ang.sin(), ang.cos()


def apply_rotary(x, sin, cos):
    sin = sin[None, :, None, :].to(x.dtype)
    cos = cos[None, :, None, :].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class MultiheadAttention(nn.Module):
    def __init__(self, model_dim, num_heads, num_kv_heads, key_norm=True):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.per_head_dim = model_dim // num_heads
        self.i_proj = GroupedQKVLinear(model_dim, num_heads, num_kv_heads, self.per_head_dim)
        self.scale_query = ScaleQuery(self.per_head_dim, norm=True)
        self.scale_key = ScaleKey(self.per_head_dim, norm=key_norm)
        self.o_proj = nn.Parameter(torch.randn(model_dim, num_heads, self.per_head_dim) * model_dim ** -0.5)

    def forward(self, query):
        b, t, _ = query.shape
        q, k, v = self.i_proj(query)
        q = self.scale_query(q)
        k = self.scale_key(k)
        sin, cos = rotary_sin_cos(torch.arange(t, device=query.device), self.per_head_dim)
        q = apply_rotary(q, sin.to(query.device), cos.to(query.device))
        k = apply_rotary(k, sin.to(query.device), cos.to(query.device))
        q = q * (self.per_head_dim ** -0.5)
        groups = self.num_heads // self.num_kv_heads
        q = q.reshape(b, t, self.num_kv_heads, groups, self.per_head_dim)
        logits = torch.einsum("btkgh,bskh->bkgts", q, k)
        causal = torch.ones(t, t, dtype=torch.bool, device=query.device).triu(1)
        logits = logits.masked_fill(causal, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        context = torch.einsum("bkgts,bskh->btkgh", probs, v).reshape(b, t, self.num_heads, self.per_head_dim)
        return torch.einsum("btnh,dnh->btd", context, self.o_proj)


class TransformerAttentionLayer(nn.Module):
    def __init__(self, model_dim, num_heads, num_kv_heads, key_norm=True):
        super().__init__()
        self.norm = RMSNorm(model_dim)
        self.attention = MultiheadAttention(model_dim, num_heads, num_kv_heads, key_norm)

    def forward(self, x):
        return x + self.attention(self.norm(x))


class TransformerFeedForwardLayer(nn.Module):
    def __init__(self, model_dim, hidden_dim):
        super().__init__()
        self.norm = RMSNorm(model_dim)
        self.linear1_0 = nn.Linear(model_dim, hidden_dim, bias=False)
        self.linear1_1 = nn.Linear(model_dim, hidden_dim, bias=False)
        self.linear2 = nn.Linear(hidden_dim, model_dim, bias=False)

    def forward(self, x):
        h = self.norm(x)
        return x + self.linear2(F.silu(self.linear1_0(h)) * self.linear1_1(h))


class TransformerLayer(nn.Module):
    def __init__(self, model_dim, num_heads, num_kv_heads, hidden_dim, key_norm=True):
        super().__init__()
        self.self_attention = TransformerAttentionLayer(model_dim, num_heads, num_kv_heads, key_norm)
        self.feed_forward = TransformerFeedForwardLayer(model_dim, hidden_dim)

    def forward(self, x):
        return self.feed_forward(self.self_attention(x))


class StackedTransformer(nn.Module):
    def __init__(self, num_layers, model_dim, num_heads, num_kv_heads, hidden_dim, key_norm_off=(1,)):
        super().__init__()
        self.num_layers = num_layers
        for i in range(num_layers):
            self.add_module(f"layer{i}", TransformerLayer(model_dim, num_heads, num_kv_heads, hidden_dim,
                                                          key_norm=(i not in key_norm_off)))

    def forward(self, x):
        for i in range(self.num_layers):
            x = getattr(self, f"layer{i}")(x)
        return x


class Embedding(nn.Module):
    def __init__(self, vocab_size, dim):
        super().__init__()
        self.token_emb = nn.Embedding(vocab_size, dim)

    def forward(self, ids):
        return self.token_emb(ids)


class Decoder(nn.Module):
    def __init__(self, vocab_size=96, model_dim=64, num_layers=3, num_heads=4, num_kv_heads=2, hidden_dim=128):
        super().__init__()
        self.emb = Embedding(vocab_size, model_dim)
        self.transformer = StackedTransformer(num_layers, model_dim, num_heads, num_kv_heads, hidden_dim)
        self.output_norm = RMSNorm(model_dim)
        self.lm_head = nn.Linear(model_dim, vocab_size, bias=False)

    def forward(self, input_ids):
        return self.lm_head(self.output_norm(self.transformer(self.emb(input_ids))))


class CausalLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.decoder = Decoder()

    def forward(self, input_ids):
        return self.decoder(input_ids)


def make_model():
    torch.manual_seed(1508)
    model = CausalLM()
    g = torch.Generator().manual_seed(15081)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.scale.copy_(1.0 + 0.3 * torch.randn(m.scale.shape, generator=g))
    return model.eval()

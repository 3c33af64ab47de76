"""ComfyUI `comfy/ldm/modules/attention.py` `CrossAttention` in plain torch (the `ops.Linear` operations
replaced by nn.Linear): bias-free `to_q`/`to_k`/`to_v` (`to_k`/`to_v` read `context_dim` features),
`to_out = Sequential(Linear, Dropout)`, `context = default(context, x)`, and `optimized_attention`
dispatched to `attention_basic` (einsum over (b*heads, tokens, dim_head) folds, `sim.softmax(dim=-1)`).

This file: one bug: the fold reshapes (b, tokens, heads * dim_head) straight to (b * heads, -1, dim_head) (the skip_reshape shortcut), so each 'head' holds pieces of several tokens."""

import torch
from torch import nn


def exists(val):
    return val is not None


def default(val, d):
    return val if exists(val) else d


def attention_basic(q, k, v, heads, mask=None, attn_precision=None):
    b, _, dim_head = q.shape
    dim_head //= heads
    scale = dim_head ** -0.5
    q, k, v = map(lambda t: t.reshape(b * heads, -1, dim_head).contiguous(), (q, k, v))
    sim = torch.einsum("b i d, b j d -> b i j", q, k) * scale
    del q, k
    if exists(mask):
        sim = sim + mask
    sim = sim.softmax(dim=-1)
    out = torch.einsum("b i j, b j d -> b i d", sim.to(v.dtype), v)
    out = (
        out.unsqueeze(0)
        .reshape(b, heads, -1, dim_head)
        .permute(0, 2, 1, 3)
        .reshape(b, -1, heads * dim_head)
    )
    return out


def attention_pytorch(q, k, v, heads, mask=None, attn_precision=None):
    """The SDPA path, with scaled_dot_product_attention written out."""
    b, _, dim_head = q.shape
    dim_head //= heads
    q, k, v = map(lambda t: t.view(b, -1, heads, dim_head).transpose(1, 2), (q, k, v))
    w = q @ k.transpose(-2, -1) * dim_head ** -0.5
    if mask is not None:
        w = w + mask
    w = w.softmax(dim=-1)
    out = w @ v
    return out.transpose(1, 2).reshape(b, -1, heads * dim_head)


optimized_attention = attention_basic


class CrossAttention(nn.Module):
    def __init__(self, query_dim, context_dim=None, heads=8, dim_head=64, dropout=0.0, attn_precision=None):
        super().__init__()
        inner_dim = dim_head * heads
        context_dim = default(context_dim, query_dim)
        self.attn_precision = attn_precision
        self.heads = heads
        self.dim_head = dim_head
        self.to_q = nn.Linear(query_dim, inner_dim, bias=False)
        self.to_k = nn.Linear(context_dim, inner_dim, bias=False)
        self.to_v = nn.Linear(context_dim, inner_dim, bias=False)
        self.to_out = nn.Sequential(nn.Linear(inner_dim, query_dim), nn.Dropout(dropout))

    def forward(self, x, context=None, value=None, mask=None):
        q = self.to_q(x)
        context = default(context, x)
        k = self.to_k(context)
        if value is not None:
            v = self.to_v(value)
            del value
        else:
            v = self.to_v(context)
        out = optimized_attention(q, k, v, self.heads, mask, attn_precision=self.attn_precision)
        return self.to_out(out)


def make_comfy_self_basic():
    torch.manual_seed(1974)
    return CrossAttention(query_dim=64, heads=8, dim_head=8).eval()


EXPECT = {'target': 'make_comfy_self_basic',
 'kind': 'multihead',
 'ok': False,
 'layer': '',
 'stage': 'queries',
 'mistake': 'heads_split',
 'style': 'ComfyUI comfy.ldm CrossAttention: (b, n, h*d) folded straight to (b*h, n, d) without '
          'the head permute'}

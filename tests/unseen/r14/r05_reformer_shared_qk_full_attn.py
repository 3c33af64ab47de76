"""reformer_pytorch FullQKAttention behind LSHSelfAttention.

This file: refused (shared query/key with normalised keys and a token-self penalty)."""

import torch
import torch.nn.functional as F
from torch import nn

TOKEN_SELF_ATTN_VALUE = -5e4  # carefully set for half precision to work


def default(val, default_val):
    return default_val if val is None else val


def max_neg_value(tensor):
    return -torch.finfo(tensor.dtype).max


class FullQKAttention(nn.Module):
    """Full attention with shared query/key: keys are the L2-normalised queries, self-attention discouraged."""

    def __init__(self, causal=False, dropout=0.0):
        super().__init__()
        self.causal = causal
        self.dropout = nn.Dropout(dropout)

    def forward(self, qk, v, query_len=None, input_mask=None, input_attn_mask=None, **kwargs):
        b, seq_len, dim = qk.shape
        query_len = default(query_len, seq_len)
        t = query_len

        q = qk[:, 0:query_len]
        qk = F.normalize(qk, 2, dim=-1).type_as(q)

        dot = torch.einsum("bie,bje->bij", q, qk) * (dim**-0.5)

        # qk attention requires tokens not attend to self
        i = torch.arange(t)
        dot[:, i, i] = TOKEN_SELF_ATTN_VALUE
        masked_value = max_neg_value(dot)

        if self.causal:
            i, j = torch.triu_indices(t, t, 1)
            dot[:, i, j] = masked_value

        dot = dot.softmax(dim=-1)
        dot = self.dropout(dot)
        out = torch.einsum("bij,bje->bie", dot, v)
        return out, dot, torch.empty(0)


class LSHSelfAttention(nn.Module):
    """reformer_pytorch LSHSelfAttention with use_full_attn=True (the LSH buckets never used)."""

    def __init__(self, dim, heads=4, dim_head=None, causal=False):
        super().__init__()
        assert dim_head or (dim % heads) == 0, "dimensions must be divisible by number of heads"
        dim_head = default(dim_head, dim // heads)
        dim_heads = dim_head * heads
        self.dim = dim
        self.heads = heads
        self.dim_head = dim_head
        self.toqk = nn.Linear(dim, dim_heads, bias=False)
        self.tov = nn.Linear(dim, dim_heads, bias=False)
        self.to_out = nn.Linear(dim_heads, dim)
        self.full_attn = FullQKAttention(causal=causal)

    def forward(self, x, keys=None, input_mask=None, input_attn_mask=None, **kwargs):
        b, t, e, h, dh = *x.shape, self.heads, self.dim_head
        qk = self.toqk(x)
        v = self.tov(x)

        def merge_heads(v):
            return v.view(b, t, h, -1).transpose(1, 2)

        def merge_batch_and_heads(v):
            return v.reshape(b * h, -1, v.shape[-1])

        qk, v = map(merge_heads, (qk, v))
        qk, v = map(merge_batch_and_heads, (qk, v))
        out, attn, buckets = self.full_attn(qk, v, query_len=t)

        out = out.view(b, h, t, -1).transpose(1, 2).contiguous().view(b, t, -1)
        return self.to_out(out)


class PreNorm(nn.Module):
    def __init__(self, norm_class, dim, fn):
        super().__init__()
        self.norm = norm_class(dim)
        self.fn = fn

    def forward(self, x, **kwargs):
        return self.fn(self.norm(x), **kwargs)


class ReformerLite(nn.Module):
    """One reversible-free Reformer layer: y = x + attn(norm(x)); z = y + ff(norm(y))."""

    def __init__(self, dim=64, heads=4):
        super().__init__()
        self.attn = PreNorm(nn.LayerNorm, dim, LSHSelfAttention(dim, heads=heads))
        self.ff = PreNorm(
            nn.LayerNorm,
            dim,
            nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)),
        )

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.ff(x)


def make_reformer():
    torch.manual_seed(1465)
    model = ReformerLite()
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.6, 1.4)
                mod.bias.normal_(0.0, 0.1)
    return model.eval()


EXPECT = {
    "target": "make_reformer",
    "kind": "multihead",
    "ok": True,
    "layer": "attn.fn",
    "unsupported": "shared_qk",
    "style": "reformer_pytorch LSHSelfAttention with use_full_attn: shared toqk projection, keys are the"
    " L2-normalised queries, the diagonal set to -5e4 (no self-attention), heads folded into "
    "the batch",
}

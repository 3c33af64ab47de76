"""lucidrains linformer: LinformerSelfAttention inside PreNorm inside SequentialSequence.

This file: refused (keys and values compressed along the sequence axis)."""

import math

import torch
from torch import nn


def default(val, default_val):
    return val if val is not None else default_val


def init_(tensor):
    dim = tensor.shape[-1]
    std = 1 / math.sqrt(dim)
    tensor.uniform_(-std, std)
    return tensor


class PreNorm(nn.Module):
    def __init__(self, dim, fn):
        super().__init__()
        self.fn = fn
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        return self.fn(self.norm(x))


class FeedForward(nn.Module):
    def __init__(self, dim, mult=4):
        super().__init__()
        self.w1 = nn.Linear(dim, dim * mult)
        self.act = nn.GELU()
        self.w2 = nn.Linear(dim * mult, dim)

    def forward(self, x):
        return self.w2(self.act(self.w1(x)))


class LinformerSelfAttention(nn.Module):
    def __init__(
        self, dim, seq_len, k=16, heads=4, dim_head=None, one_kv_head=False, share_kv=False
    ):
        super().__init__()
        assert (dim % heads) == 0, "dimension must be divisible by the number of heads"
        self.seq_len = seq_len
        self.k = k
        self.heads = heads
        dim_head = default(dim_head, dim // heads)
        self.dim_head = dim_head
        self.to_q = nn.Linear(dim, dim_head * heads, bias=False)
        kv_dim = dim_head if one_kv_head else (dim_head * heads)
        self.to_k = nn.Linear(dim, kv_dim, bias=False)
        self.proj_k = nn.Parameter(init_(torch.zeros(seq_len, k)))
        self.share_kv = share_kv
        if not share_kv:
            self.to_v = nn.Linear(dim, kv_dim, bias=False)
            self.proj_v = nn.Parameter(init_(torch.zeros(seq_len, k)))
        self.to_out = nn.Linear(dim_head * heads, dim)

    def forward(self, x, context=None):
        b, n, d, d_h, h, k = *x.shape, self.dim_head, self.heads, self.k
        kv_len = n if context is None else context.shape[1]
        assert kv_len <= self.seq_len, (
            f"the sequence length of the key / values must be at most {self.seq_len}"
        )

        queries = self.to_q(x)
        kv_input = x if context is None else context
        keys = self.to_k(kv_input)
        values = self.to_v(kv_input) if not self.share_kv else keys

        # project the sequence axis n -> k (the low-rank step)
        kv_projs = (self.proj_k, self.proj_v if not self.share_kv else self.proj_k)
        kv_projs = map(lambda t: t[:kv_len], kv_projs)
        keys, values = map(
            lambda args: torch.einsum("bnd,nk->bkd", *args), zip((keys, values), kv_projs)
        )

        queries = queries.reshape(b, n, h, -1).transpose(1, 2)
        merge_key_values = lambda t: t.reshape(b, k, -1, d_h).transpose(1, 2).expand(-1, h, -1, -1)
        keys, values = map(merge_key_values, (keys, values))

        dots = torch.einsum("bhnd,bhkd->bhnk", queries, keys) * (d_h**-0.5)
        attn = dots.softmax(dim=-1)
        out = torch.einsum("bhnk,bhkd->bhnd", attn, values)
        out = out.transpose(1, 2).reshape(b, n, -1)
        return self.to_out(out)


class SequentialSequence(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = layers

    def forward(self, x):
        for attn, ff in self.layers:
            x = x + attn(x)
            x = x + ff(x)
        return x


class Linformer(nn.Module):
    def __init__(self, dim=64, seq_len=64, depth=1, k=16, heads=4):
        super().__init__()
        layers = nn.ModuleList([])
        for _ in range(depth):
            attn = LinformerSelfAttention(dim, seq_len, k=k, heads=heads)
            layers.append(nn.ModuleList([PreNorm(dim, attn), PreNorm(dim, FeedForward(dim))]))
        self.net = SequentialSequence(layers)

    def forward(self, x):
        return self.net(x)


def make_linformer():
    torch.manual_seed(1464)
    model = Linformer()
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.6, 1.4)
                mod.bias.normal_(0.0, 0.1)
    return model.eval()


EXPECT = {
    "target": "make_linformer",
    "kind": "multihead",
    "ok": True,
    "layer": "net.layers.0.0.fn",
    "unsupported": "low_rank_projection",
    "style": "lucidrains linformer LinformerSelfAttention: keys and values projected along the sequence "
    "axis with proj_k/proj_v[:n] (n -> k = 16) by einsum 'bnd,nk->bkd' before the softmax",
}

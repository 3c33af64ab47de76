"""More implementations in other styles (correct unless the comment names a bug), written
after the gallery to probe the checker; see tests/test_check_variants.py."""

import math

import torch
import torch.nn.functional as F
from torch import nn


class RenormAfterSoftmax(nn.Module):  # correct: softmax, zero future, renormalise
    def __init__(self, d_in, d_out, context_length):
        super().__init__()
        self.q = nn.Linear(d_in, d_out, bias=False)
        self.k = nn.Linear(d_in, d_out, bias=False)
        self.v = nn.Linear(d_in, d_out, bias=False)
        self.register_buffer("tril", torch.tril(torch.ones(context_length, context_length)))

    def forward(self, x):
        t = x.shape[-2]
        q, k, v = self.q(x), self.k(x), self.v(x)
        w = (
            torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(k.shape[-1]), dim=-1)
            * self.tril[:t, :t]
        )
        w = w / w.sum(-1, keepdim=True)
        return w @ v


class PerHeadLoop(nn.Module):  # correct multihead: loop over heads, stack
    def __init__(self, embed_dim, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, x, mask=None):
        hd = x.shape[-1] // self.num_heads
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        outs = []
        for h in range(self.num_heads):
            sl = slice(h * hd, (h + 1) * hd)
            a = torch.softmax(torch.einsum("bqd,bkd->bqk", q[..., sl], k[..., sl]) / hd**0.5, -1)
            outs.append(a @ v[..., sl])
        return self.out_proj(torch.cat(outs, -1)), None


class BaddbmmAlpha(nn.Module):  # correct: baddbmm with alpha=scale, 3 outputs
    def __init__(self, d_in, d_out):
        super().__init__()
        self.Wq = nn.Parameter(torch.randn(d_in, d_out) * 0.3)
        self.Wk = nn.Parameter(torch.randn(d_in, d_out) * 0.3)
        self.Wv = nn.Parameter(torch.randn(d_in, d_out) * 0.3)

    def forward(self, x):
        q, k, v = x @ self.Wq, x @ self.Wk, x @ self.Wv
        s = torch.baddbmm(
            torch.zeros(x.shape[0], x.shape[1], x.shape[1]),
            q,
            k.transpose(1, 2),
            beta=0,
            alpha=1 / math.sqrt(q.shape[-1]),
        )
        w = s.softmax(-1)
        return torch.bmm(w, v), w, s


class HeadsMergeWrongAxis(PerHeadLoop):  # cat along tokens axis then reshape -> heads_merge?
    def forward(self, x, mask=None):
        b, t, d = x.shape
        hd = d // self.num_heads
        q, k, v = (
            p(x).view(b, t, self.num_heads, hd).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        ctx = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(ctx.transpose(1, 2).transpose(2, 3).reshape(b, t, d)), None


class KeysRolled(BaddbmmAlpha):  # wrong key index: keys shifted by one token
    def forward(self, x):
        q, k, v = x @ self.Wq, x @ self.Wk, x @ self.Wv
        k = torch.cat([k[:, 1:], k[:, :1]], dim=1)
        return torch.softmax(q @ k.transpose(1, 2) / math.sqrt(q.shape[-1]), -1) @ v


class OutProjTwice(PerHeadLoop):  # other at output
    def forward(self, x, mask=None):
        y, _ = super().forward(x)
        return self.out_proj(y), None


def simplified_batch_first(inputs):  # correct simplified using einsum, batched only
    s = torch.einsum("btd,bsd->bts", inputs, inputs)
    return torch.einsum("bts,bsd->btd", s.softmax(-1), inputs)


def simplified_scaled(inputs):  # simplified with scaling -> wrong_scale? (reference has none)
    s = inputs @ inputs.T / math.sqrt(inputs.shape[-1])
    return torch.softmax(s, -1) @ inputs


def scores_with_softmax(inputs, query_index):  # returns weights instead of raw scores
    return torch.softmax(inputs @ inputs[query_index], 0)


def scores_cos(inputs, query_index):
    return F.cosine_similarity(inputs, inputs[query_index].unsqueeze(0), dim=-1)


def scores_loop_manual(inputs, query_index):
    q = inputs[query_index]
    out = torch.empty(inputs.shape[0])
    for i in range(inputs.shape[0]):
        acc = 0.0
        for a, b in zip(inputs[i], q, strict=False):
            acc += a * b
        out[i] = acc
    return out

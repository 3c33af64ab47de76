"""More implementations in other styles (correct unless the comment names a bug), written
after the gallery to probe the checker; see tests/test_check_variants.py."""

import math

import torch
import torch.nn.functional as F
from torch import nn


class SdpaNoCausal(nn.Module):  # causal module, forgot is_causal -> missing_mask
    def __init__(self, d_in, d_out, context_length, num_heads):
        super().__init__()
        self.h = num_heads
        self.qkv = nn.Linear(d_in, 3 * d_out)
        self.proj = nn.Linear(d_out, d_out)
        self.register_buffer("mask", torch.tril(torch.ones(context_length, context_length)))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).split(self.proj.in_features, dim=-1)
        q, k, v = (z.view(b, t, self.h, -1).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class SdpaScale1(SdpaNoCausal):  # scale=1.0 -> missing_scale
    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).split(self.proj.in_features, dim=-1)
        q, k, v = (z.view(b, t, self.h, -1).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class OldHFMask(nn.Module):  # correct: additive -10000 mask, float64 softmax
    def __init__(self, d_model, n_heads, max_len):
        super().__init__()
        self.n_heads = n_heads
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.o = nn.Linear(d_model, d_model)
        self.register_buffer(
            "bias", torch.tril(torch.ones(max_len, max_len)).view(1, 1, max_len, max_len)
        )

    def forward(self, x):
        b, t, d = x.shape
        hd = d // self.n_heads

        def sh(z):
            return z.view(b, t, self.n_heads, hd).permute(0, 2, 1, 3)

        q, k, v = sh(self.q(x)), sh(self.k(x)), sh(self.v(x))
        s = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(hd)
        s = s + (1.0 - self.bias[:, :, :t, :t]) * -10000.0
        w = F.softmax(s.double(), dim=-1).to(q.dtype)
        return self.o(torch.matmul(w, v).permute(0, 2, 1, 3).reshape(b, t, d))


class BoolKeepMask(nn.Module):  # correct: sdpa with bool mask True=keep, explicit scale
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.to_qkv = nn.Linear(dim, dim * 3, bias=False)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.to_qkv(x).chunk(3, dim=-1)
        q, k, v = (z.reshape(b, n, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        keep = torch.ones(n, n, dtype=torch.bool).tril()
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=(d // self.heads) ** -0.5)
        return self.to_out(o.transpose(1, 2).reshape(b, n, d))


class ValuesFromKeyCombined(BoolKeepMask):  # wrong_projection at values
    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.to_qkv(x).chunk(3, dim=-1)
        v = k
        q, k, v = (z.reshape(b, n, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.to_out(o.transpose(1, 2).reshape(b, n, d))


class NoBiasInQuery(nn.Module):  # correct single head with bias on all
    def __init__(self, d_in, d_out):
        super().__init__()
        self.wq = nn.Linear(d_in, d_out)
        self.wk = nn.Linear(d_in, d_out)
        self.wv = nn.Linear(d_in, d_out)

    def forward(self, x):
        q = self.wq(x) * self.wq.out_features**-0.5
        return torch.softmax(torch.einsum("...id,...jd->...ij", q, self.wk(x)), -1) @ self.wv(x)


class SoftmaxBatchDim(NoBiasInQuery):  # softmax over dim=0 batched
    def forward(self, x):
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        s = q @ k.transpose(-2, -1) / math.sqrt(k.size(-1))
        return F.softmax(s, dim=0) @ v


class TwoScale(NoBiasInQuery):  # scale applied twice -> wrong_scale 1/d_k
    def forward(self, x):
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        q = q / math.sqrt(k.size(-1))
        s = q @ k.transpose(-2, -1) / math.sqrt(k.size(-1))
        return F.softmax(s, dim=-1) @ v


class MaskFillNeg5(nn.Module):  # causal, fill -5 -> mask_fill_value
    def __init__(self, d_in, d_out, context_length):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=False)
        self.W_key = nn.Linear(d_in, d_out, bias=False)
        self.W_value = nn.Linear(d_in, d_out, bias=False)
        self.register_buffer(
            "mask", torch.triu(torch.ones(context_length, context_length), 1).bool()
        )

    def forward(self, x):
        t = x.shape[1]
        q, k, v = self.W_query(x), self.W_key(x), self.W_value(x)
        s = (q @ k.transpose(1, 2)).masked_fill(self.mask[:t, :t], -5.0)
        return torch.softmax(s / k.shape[-1] ** 0.5, -1) @ v


class RowSumAfterExp(MaskFillNeg5):  # correct manual stable softmax
    def forward(self, x):
        t = x.shape[1]
        q, k, v = self.W_query(x), self.W_key(x), self.W_value(x)
        s = (q @ k.transpose(1, 2)) / k.shape[-1] ** 0.5
        s = s.masked_fill(self.mask[:t, :t], float("-inf"))
        e = torch.exp(s - s.max(-1, keepdim=True).values)
        return (e / e.sum(-1, keepdim=True)) @ v

"""levanter's MPT port (Haliax) with `hax.nn.attention.alibi_attention_bias`, in torch.

A fused `Wqkv` projection split into three equal parts, heads as a named axis, no rotary. The ALiBi
bias is built by the model once per call from the slopes 2^(-bias_max * (h + 1) / num_heads) and the
signed distance, added after the 1/sqrt(head_dim) scale, then the mask is applied with `where(mask,
logits, -1e9)` before the softmax; `out_proj` merges the heads. Bidirectional encoder (no mask): bias -slope * |q - k|.

This file: correct (8 heads, slopes 2^-1..2^-8, bidirectional -slope*|q-k|, no mask)."""

import math

import torch
from torch import nn


class MptConfig:
    d_model = 64
    n_heads = 8
    alibi_bias_max = 8
    causal = False


def alibi_attention_bias(num_heads, q_len, k_len, bias_max, dtype):
    """(heads, position, key_position) linear bias."""
    slopes = 2.0 ** (-bias_max * torch.arange(1, num_heads + 1, dtype=torch.float64) / num_heads)
    q_pos = torch.arange(q_len, dtype=torch.float64)[:, None]
    k_pos = torch.arange(k_len, dtype=torch.float64)[None, :]
    dist = -(k_pos - q_pos).abs()  # symmetric, encoder
    return (slopes[:, None, None] * dist[None]).to(dtype)


class MptAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.head_dim = config.d_model // config.n_heads
        self.Wqkv = nn.Linear(config.d_model, 3 * config.d_model, bias=True)
        self.out_proj = nn.Linear(config.d_model, config.d_model, bias=True)

    def forward(self, x, attn_bias, mask):
        b, n, d = x.shape
        h, hd = self.config.n_heads, self.head_dim
        q, k, v = self.Wqkv(x).split(d, dim=-1)
        q = q.view(b, n, h, hd).transpose(1, 2)
        k = k.view(b, n, h, hd).transpose(1, 2)
        v = v.view(b, n, h, hd).transpose(1, 2)
        logits = torch.einsum("bhqd,bhkd->bhqk", q, k) * (1.0 / math.sqrt(hd))
        logits = logits + attn_bias
        if mask is not None:
            logits = torch.where(mask, logits, -1e9)
        weights = torch.softmax(logits, dim=-1)
        out = torch.einsum("bhqk,bhkd->bhqd", weights, v)
        return self.out_proj(out.transpose(1, 2).reshape(b, n, d))


class MptBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.norm_1 = nn.LayerNorm(config.d_model)
        self.attn = MptAttention(config)

    def forward(self, x, attn_bias, mask):
        return x + self.attn(self.norm_1(x), attn_bias, mask)


class MptModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList([MptBlock(config)])

    def forward(self, x):
        n = x.shape[1]
        bias = alibi_attention_bias(self.config.n_heads, n, n, self.config.alibi_bias_max, x.dtype)
        mask = None
        if self.config.causal:
            mask = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        for block in self.blocks:
            x = block(x, bias, mask)
        return x


def make_mpt():
    torch.manual_seed(1812)
    model = MptModel(MptConfig())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {'target': 'make_mpt',
 'kind': 'multihead',
 'layer': 'blocks.0.attn',
 'ok': True,
 'structure': {'heads': 8,
               'kv_heads': 8,
               'head_dim': 8,
               'causal': False,
               'cross': False,
               'rope': None,
               'qk_norm': None,
               'window': None,
               'bias': 'alibi'},
 'style': 'levanter/Haliax MPT-style encoder: symmetric ALiBi -slope*|q-k| for 8 heads, no causal '
          'mask'}

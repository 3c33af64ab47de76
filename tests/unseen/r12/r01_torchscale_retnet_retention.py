"""microsoft/torchscale RetNet style MultiScaleRetention (parallel form) in a pre-LN RetNet layer:
q/k/v/g projections, per-head decay gamma = 1 - 2**(-5 - arange(H)) as a lower-triangular decay
matrix gamma**(n - m) normalised by the square root of its row sums, retention = (q @ k^T * scale)
* decay with no softmax (rows divided by their clamped absolute sums), @ v, a per-head GroupNorm,
a swish gate and out_proj. Outside the vocabulary: there is no softmax; the decay weights tokens."""

import math

import torch
import torch.nn.functional as F
from torch import nn


class MultiScaleRetention(nn.Module):
    def __init__(self, embed_dim=64, value_dim=64, num_heads=4):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = value_dim // num_heads
        self.key_dim = embed_dim // num_heads
        self.scaling = self.key_dim**-0.5
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.v_proj = nn.Linear(embed_dim, value_dim, bias=False)
        self.g_proj = nn.Linear(embed_dim, value_dim, bias=False)
        self.out_proj = nn.Linear(value_dim, embed_dim, bias=False)
        self.group_norm = nn.LayerNorm(self.head_dim, eps=1e-6, elementwise_affine=False)
        decay = torch.log(1 - 2 ** (-5 - torch.arange(num_heads, dtype=torch.float64)))
        self.register_buffer("decay", decay, persistent=False)

    def decay_mask(self, slen, dtype):
        index = torch.arange(slen, dtype=torch.float64)
        mask = torch.tril(torch.ones(slen, slen, dtype=torch.bool))
        mask = torch.masked_fill(index[:, None] - index[None, :], ~mask, float("inf"))
        mask = torch.exp(mask * self.decay[:, None, None])
        mask = torch.nan_to_num(mask)
        mask = mask / mask.sum(dim=-1, keepdim=True).sqrt()
        return mask.to(dtype)

    def forward(self, x):
        bsz, tgt_len, _ = x.size()
        q = self.q_proj(x)
        k = self.k_proj(x) * self.scaling
        v = self.v_proj(x)
        g = self.g_proj(x)
        q = q.view(bsz, tgt_len, self.num_heads, self.key_dim).transpose(1, 2)
        k = k.view(bsz, tgt_len, self.num_heads, self.key_dim).transpose(1, 2)
        v = v.view(bsz, tgt_len, self.num_heads, self.head_dim).transpose(1, 2)
        qk_mat = q @ k.transpose(-1, -2)
        qk_mat = qk_mat * self.decay_mask(tgt_len, x.dtype)
        qk_mat = qk_mat / qk_mat.detach().abs().sum(dim=-1, keepdim=True).clamp(min=1)
        output = torch.matmul(qk_mat, v).transpose(1, 2)
        output = self.group_norm(output).reshape(bsz, tgt_len, self.head_dim * self.num_heads)
        output = F.silu(g) * output
        return self.out_proj(output)


class RetNetDecoderLayer(nn.Module):
    def __init__(self, embed_dim=64):
        super().__init__()
        self.retention = MultiScaleRetention(embed_dim)
        self.retention_layer_norm = nn.LayerNorm(embed_dim)

    def forward(self, x):
        return x + self.retention(self.retention_layer_norm(x))


def make_retnet_layer():
    torch.manual_seed(1291)
    layer = RetNetDecoderLayer()
    with torch.no_grad():
        layer.retention_layer_norm.weight.uniform_(0.5, 1.5)
        layer.retention_layer_norm.bias.uniform_(-0.2, 0.2)
    return layer.eval()


EXPECT = {
    "target": "make_retnet_layer",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "retention",
    "unsupported": "retention",
    "style": "torchscale RetNet MultiScaleRetention, parallel form: decay-weighted q k^T without a "
    "softmax, row normalisation by absolute sums, per-head GroupNorm and a swish gate",
}

"""TimesFM-style (Google time-series foundation model) torch attention: fused qkv_proj, queries scaled
per dimension by 1.442695041 / sqrt(head_dim) * softplus(per_dim_scale) (a learned vector, not one
scalar), causal mask over patches, o_proj; pre-RMSNorm decoder layer."""

import math

import torch
import torch.nn.functional as F
from torch import nn


class TimesFMAttention(nn.Module):
    def __init__(self, hidden_size=64, num_heads=4, head_dim=16):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.q_size = num_heads * head_dim
        self.qkv_proj = nn.Linear(hidden_size, 3 * self.q_size)
        self.o_proj = nn.Linear(self.q_size, hidden_size)
        self.per_dim_scale = nn.Parameter(torch.zeros(head_dim))

    def _per_dim_scaling(self, query):
        r_softplus_0 = 1.442695041
        scale = r_softplus_0 / math.sqrt(self.head_dim)
        scale = scale * F.softplus(self.per_dim_scale)
        return query * scale[None, None, None, :]

    def forward(self, hidden_states, mask):
        b, n, _ = hidden_states.shape
        qkv = self.qkv_proj(hidden_states)
        xq, xk, xv = qkv.split([self.q_size, self.q_size, self.q_size], dim=-1)
        xq = xq.view(b, n, self.num_heads, self.head_dim)
        xk = xk.view(b, n, self.num_heads, self.head_dim)
        xv = xv.view(b, n, self.num_heads, self.head_dim)
        xq = self._per_dim_scaling(xq)
        q, k, v = xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2)
        scores = torch.matmul(q, k.transpose(2, 3)) + mask
        scores = F.softmax(scores, dim=-1)
        out = torch.matmul(scores, v).transpose(1, 2).reshape(b, n, -1)
        return self.o_proj(out)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.weight)


class TimesFMDecoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm = RMSNorm(64)
        self.self_attn = TimesFMAttention()

    def forward(self, hidden_states):
        n = hidden_states.shape[1]
        mask = torch.full(
            (n, n), torch.finfo(hidden_states.dtype).min, dtype=hidden_states.dtype
        ).triu(1)
        return hidden_states + self.self_attn(self.input_layernorm(hidden_states), mask[None, None])


def make_timesfm_layer():
    torch.manual_seed(1113)
    layer = TimesFMDecoderLayer()
    with torch.no_grad():
        layer.input_layernorm.weight.uniform_(-0.5, 0.5)
        layer.self_attn.per_dim_scale.uniform_(-1.5, 1.5)
    return layer.eval()


EXPECT = {
    "target": "make_timesfm_layer",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "self_attn",
    "unsupported": "per_dim_scale",
    "style": "TimesFM-style attention: learned per-dimension query scaling softplus(per_dim_scale) * 1.442695041 / sqrt(head_dim) "
    "(a different factor for each of the 16 query dims), causal",
}

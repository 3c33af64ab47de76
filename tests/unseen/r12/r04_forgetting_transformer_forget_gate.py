"""Forgetting Transformer (FoX, zhixuan-lin/forgetting-transformer) style ForgettingAttention written
without the Triton kernel, in a pre-LN layer: q/k/v/o projections, a per-head forget gate
f_t = sigmoid(fgate_proj(x)) whose log is cumsum'd over time, the data-dependent bias
log_fgate_cum[i] - log_fgate_cum[j] added to the scaled scores, a causal mask, softmax, o_proj.
Outside the vocabulary: the position bias depends on the input (not ALiBi, not a learned table)."""

import math

import torch
import torch.nn.functional as F
from torch import nn


class ForgettingAttention(nn.Module):
    def __init__(self, hidden_size=64, num_heads=4):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.k_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.v_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.fgate_proj = nn.Linear(hidden_size, num_heads, bias=True)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)

    def forward(self, hidden_states):
        b, t, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        log_fgate = F.logsigmoid(self.fgate_proj(hidden_states).float()).transpose(1, 2)  # b h t
        log_fgate_cum = torch.cumsum(log_fgate, dim=-1).to(q.dtype)
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        scores = scores + log_fgate_cum[..., :, None] - log_fgate_cum[..., None, :]
        causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(b, t, -1)
        return self.o_proj(out)


class ForgettingTransformerLayer(nn.Module):
    def __init__(self, hidden_size=64):
        super().__init__()
        self.attn_norm = nn.LayerNorm(hidden_size)
        self.attn = ForgettingAttention(hidden_size)

    def forward(self, x):
        return x + self.attn(self.attn_norm(x))


def make_fox_layer():
    torch.manual_seed(1294)
    layer = ForgettingTransformerLayer()
    with torch.no_grad():
        layer.attn_norm.weight.uniform_(0.5, 1.5)
        layer.attn_norm.bias.uniform_(-0.2, 0.2)
        layer.attn.fgate_proj.bias.uniform_(0.0, 2.0)
    return layer.eval()


EXPECT = {
    "target": "make_fox_layer",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "attn",
    "unsupported": "forget_gate_bias",
    "style": "Forgetting Transformer ForgettingAttention: a data-dependent bias from cumsum'd log "
    "sigmoid forget gates added to the scaled scores (no Triton kernel)",
}

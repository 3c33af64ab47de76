"""Multi-head attention (GAT-style) whose heads are each d_out wide and averaged instead of concatenated."""

import torch
import torch.nn as nn


class AveragedHeadsAttention(nn.Module):
    def __init__(self, d_in, d_out, num_heads, qkv_bias=False):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = d_out
        self.W_query = nn.Linear(d_in, num_heads * d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, num_heads * d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, num_heads * d_out, bias=qkv_bias)

    def forward(self, x):
        b, t, _ = x.shape
        split = lambda z: z.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        q, k, v = split(self.W_query(x)), split(self.W_key(x)), split(self.W_value(x))
        w = torch.softmax(q @ k.transpose(-2, -1) / self.head_dim**0.5, dim=-1)
        return (w @ v).mean(dim=1)


EXPECT = {
    "target": "AveragedHeadsAttention",
    "kind": "multihead",
    "ok": False,
    "stage": "output",
    "mistake": "heads_merge",
}

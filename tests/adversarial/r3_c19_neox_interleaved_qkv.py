"""GPT-NeoX-style fused qkv: output viewed as (b, t, heads, 3*head_dim) and split per head (interleaved layout)."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class NeoXAttention(nn.Module):
    def __init__(self, d_in, d_out, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.head_size = d_out // num_heads
        self.query_key_value = nn.Linear(d_in, 3 * d_out)
        self.dense = nn.Linear(d_out, d_out)

    def forward(self, hidden_states):
        b, t, _ = hidden_states.shape
        qkv = self.query_key_value(hidden_states)
        qkv = qkv.view(b, t, self.num_heads, 3 * self.head_size).permute(0, 2, 1, 3)
        query = qkv[..., : self.head_size]
        key = qkv[..., self.head_size : 2 * self.head_size]
        value = qkv[..., 2 * self.head_size :]
        causal = torch.ones(t, t, dtype=torch.bool, device=hidden_states.device).tril()
        scores = torch.matmul(query, key.transpose(-1, -2)) / self.head_size**0.5
        scores = torch.where(causal, scores, torch.finfo(scores.dtype).min)
        probs = F.softmax(scores, dim=-1)
        out = torch.matmul(probs, value).permute(0, 2, 1, 3).reshape(b, t, -1)
        return self.dense(out)


EXPECT = {"target": "NeoXAttention", "kind": "causal-multihead", "ok": True}

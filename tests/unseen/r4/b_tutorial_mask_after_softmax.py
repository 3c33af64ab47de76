"""Tutorial-style causal multi-head attention; bug: the causal mask zeroes the weights after the softmax, so the rows no longer sum to 1."""

import math

import torch
import torch.nn as nn


class CausalMultiHeadAttention(nn.Module):
    def __init__(self, d_model, num_heads, dropout=0.0, causal=True):
        super().__init__()
        self.num_heads = num_heads
        self.d_k = d_model // num_heads
        self.causal = causal
        self.W_q = nn.Linear(d_model, d_model)
        self.W_k = nn.Linear(d_model, d_model)
        self.W_v = nn.Linear(d_model, d_model)
        self.W_o = nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        batch_size, seq_length, d_model = x.size()

        def heads(t):
            return t.view(batch_size, seq_length, self.num_heads, self.d_k).transpose(1, 2)

        Q, K, V = heads(self.W_q(x)), heads(self.W_k(x)), heads(self.W_v(x))
        attn_scores = torch.matmul(Q, K.transpose(-2, -1)) / math.sqrt(self.d_k)
        attn_probs = torch.softmax(attn_scores, dim=-1)
        if self.causal:
            mask = torch.tril(torch.ones(seq_length, seq_length, device=x.device))
            attn_probs = attn_probs.masked_fill(mask == 0, 0.0)
        attn_probs = self.dropout(attn_probs)
        out = torch.matmul(attn_probs, V)
        out = out.transpose(1, 2).contiguous().view(batch_size, seq_length, d_model)
        return self.W_o(out)


EXPECT = {
    "target": "CausalMultiHeadAttention",
    "kind": "causal-multihead",
    "ok": False,
    "stage": "weights",
    "mistake": "mask_after_softmax",
    "style": "PyTorch tutorial-style causal attention (W_q/W_k/W_v/W_o)",
}

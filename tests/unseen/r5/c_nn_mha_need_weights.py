"""nn.MultiheadAttention (batch_first) wrapped with a boolean causal mask buffer, need_weights=True, average_attn_weights=False."""

import torch
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, block_size=64, dropout=0.0, bias=True):
        super().__init__()
        self.mha = nn.MultiheadAttention(
            embed_dim, num_heads, dropout=dropout, bias=bias, batch_first=True
        )
        future = torch.triu(torch.ones(block_size, block_size, dtype=torch.bool), diagonal=1)
        self.register_buffer("future", future, persistent=False)

    def forward(self, x):
        t = x.shape[-2]
        out, per_head_weights = self.mha(
            x,
            x,
            x,
            attn_mask=self.future[:t, :t],
            need_weights=True,
            average_attn_weights=False,
        )
        return out, per_head_weights


EXPECT = {
    "target": "CausalSelfAttention",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "mha",
    "style": "nn.MultiheadAttention(batch_first=True) with need_weights=True, average_attn_weights=False, bool causal mask",
}

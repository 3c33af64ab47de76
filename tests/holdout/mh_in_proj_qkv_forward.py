"""MultiheadAttention clone: packed in_proj_weight (3E, E), forward(query, key, value)."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class PackedMHA(nn.Module):
    def __init__(self, embed_dim, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * embed_dim))
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        nn.init.xavier_uniform_(self.in_proj_weight)

    def forward(self, query, key, value, need_weights=True):
        B, L, E = query.shape
        S = key.shape[1]
        H = self.num_heads
        w_q, w_k, w_v = self.in_proj_weight.chunk(3)
        b_q, b_k, b_v = self.in_proj_bias.chunk(3)
        q = F.linear(query, w_q, b_q).reshape(B, L, H, E // H).permute(0, 2, 1, 3)
        k = F.linear(key, w_k, b_k).reshape(B, S, H, E // H).permute(0, 2, 1, 3)
        v = F.linear(value, w_v, b_v).reshape(B, S, H, E // H).permute(0, 2, 1, 3)
        attn = torch.softmax(q @ k.transpose(-2, -1) / (E // H) ** 0.5, dim=-1)
        out = (attn @ v).permute(0, 2, 1, 3).reshape(B, L, E)
        return self.out_proj(out), attn if need_weights else None


EXPECT = {"target": "PackedMHA", "kind": "multihead", "ok": True}

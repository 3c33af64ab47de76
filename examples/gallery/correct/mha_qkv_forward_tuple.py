"""nn.MultiheadAttention-like forward(query, key, value) returning (output, averaged weights)."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class MultiheadSelfAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def _shape(self, t, bsz, seq_len):
        return t.view(bsz, seq_len, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, query, key, value, need_weights=True):
        bsz, tgt_len, _ = query.shape
        src_len = key.shape[1]
        q = self._shape(self.q_proj(query), bsz, tgt_len)
        k = self._shape(self.k_proj(key), bsz, src_len)
        v = self._shape(self.v_proj(value), bsz, src_len)
        attn = torch.matmul(q, k.transpose(-1, -2)) * self.head_dim**-0.5
        attn = F.softmax(attn, dim=-1)
        out = torch.matmul(self.dropout(attn), v)
        out = out.transpose(1, 2).contiguous().view(bsz, tgt_len, self.embed_dim)
        out = self.out_proj(out)
        return out, (attn.mean(dim=1) if need_weights else None)


EXPECT = {"target": "MultiheadSelfAttention", "kind": "multihead", "ok": True}

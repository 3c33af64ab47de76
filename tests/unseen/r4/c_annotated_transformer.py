"""The Annotated Transformer's MultiHeadedAttention: clones(nn.Linear(d_model, d_model), 4), projections told apart by position."""

import math

import torch
import torch.nn as nn


def clones(module, N):
    """N identical copies of a Linear layer (same starting weights, separate parameters)."""
    layers = nn.ModuleList()
    for _ in range(N):
        twin = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
        twin.load_state_dict(module.state_dict())
        layers.append(twin)
    return layers


def attention(query, key, value, mask=None, dropout=None):
    d_k = query.size(-1)
    scores = torch.matmul(query, key.transpose(-2, -1)) / math.sqrt(d_k)
    if mask is not None:
        scores = scores.masked_fill(mask == 0, -1e9)
    p_attn = scores.softmax(dim=-1)
    if dropout is not None:
        p_attn = dropout(p_attn)
    return torch.matmul(p_attn, value), p_attn


class MultiHeadedAttention(nn.Module):
    def __init__(self, h, d_model, dropout=0.1):
        super().__init__()
        assert d_model % h == 0
        self.d_k = d_model // h
        self.h = h
        self.linears = clones(nn.Linear(d_model, d_model), 4)
        self.attn = None
        self.dropout = nn.Dropout(p=dropout)

    def forward(self, query, key, value, mask=None):
        if mask is not None:
            mask = mask.unsqueeze(1)  # same mask for every head
        nbatches = query.size(0)
        query, key, value = [
            lin(x).view(nbatches, -1, self.h, self.d_k).transpose(1, 2)
            for lin, x in zip(self.linears, (query, key, value))
        ]
        x, self.attn = attention(query, key, value, mask=mask, dropout=self.dropout)
        x = x.transpose(1, 2).contiguous().view(nbatches, -1, self.h * self.d_k)
        del query
        del key
        del value
        return self.linears[-1](x)


EXPECT = {
    "target": "MultiHeadedAttention",
    "kind": "multihead",
    "ok": True,
    "init": {"h": 3, "d_model": 12},
    "style": "Annotated Transformer MultiHeadedAttention (forward(query, key, value, mask=None))",
}

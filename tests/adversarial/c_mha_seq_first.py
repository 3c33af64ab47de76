"""Non-causal MHA in the (tokens, batch, embed) layout with an explicit batch_first = False."""

import torch
import torch.nn as nn


class SeqFirstMHA(nn.Module):
    def __init__(self, embed_dim, num_heads):
        super().__init__()
        self.batch_first = False
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, x):
        T, B, E = x.shape

        def split(t):  # (T, B, E) -> (B*H, T, hd)
            return t.contiguous().view(T, B * self.num_heads, self.head_dim).transpose(0, 1)

        q = split(self.q_proj(x)) * self.head_dim**-0.5
        k = split(self.k_proj(x))
        v = split(self.v_proj(x))
        w = torch.bmm(q, k.transpose(1, 2)).softmax(-1)
        o = torch.bmm(w, v).transpose(0, 1).contiguous().view(T, B, E)
        return self.out_proj(o)


EXPECT = {"target": "SeqFirstMHA", "kind": "multihead", "ok": True}

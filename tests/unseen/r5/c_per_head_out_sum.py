"""Per-head ModuleLists of projections; each head has its own bias-free output projection, summed, plus one shared bias; dict output."""

import torch
from torch import nn


class HeadwiseAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, bias=True):
        super().__init__()
        assert embed_dim % num_heads == 0
        self.head_dim = embed_dim // num_heads
        self.q = nn.ModuleList(
            [nn.Linear(embed_dim, self.head_dim, bias=bias) for _ in range(num_heads)]
        )
        self.k = nn.ModuleList(
            [nn.Linear(embed_dim, self.head_dim, bias=bias) for _ in range(num_heads)]
        )
        self.v = nn.ModuleList(
            [nn.Linear(embed_dim, self.head_dim, bias=bias) for _ in range(num_heads)]
        )
        self.o = nn.ModuleList(
            [nn.Linear(self.head_dim, embed_dim, bias=False) for _ in range(num_heads)]
        )
        self.o_bias = nn.Parameter(torch.empty(embed_dim).uniform_(-0.1, 0.1))

    @torch.jit.ignore
    def _one_head(self, x, i):
        q, k, v = self.q[i](x), self.k[i](x), self.v[i](x)
        logits = q @ k.transpose(-1, -2) * self.head_dim**-0.5
        probs = logits.softmax(dim=-1)
        return self.o[i](probs @ v), probs

    def forward(self, x):
        out = self.o_bias
        maps = []
        for i in range(len(self.q)):
            contribution, probs = self._one_head(x, i)
            out = out + contribution
            maps.append(probs)
        return {"output": out, "attention_maps": maps}


EXPECT = {
    "target": "HeadwiseAttention",
    "kind": "multihead",
    "ok": True,
    "style": "per-head ModuleLists, per-head output projections summed with one bias, @torch.jit.ignore helper, dict output",
}

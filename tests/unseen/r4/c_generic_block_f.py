"""Pre-norm block whose causal attention sits under the generic name self.f: combined qkv 'in_lin', output 'post', heads as self.nh, tril built in forward."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class Mixer(nn.Module):
    def __init__(self, d_model, n_head):
        super().__init__()
        self.nh = n_head
        self.in_lin = nn.Linear(d_model, 3 * d_model)
        self.post = nn.Linear(d_model, d_model)

    def forward(self, x):
        B, T, C = x.shape
        a, b, c = self.in_lin(x).chunk(3, dim=-1)
        q, k, v = (t.unflatten(-1, (self.nh, C // self.nh)).transpose(1, 2) for t in (a, b, c))
        s = q @ k.mT / math.sqrt(q.shape[-1])
        keep = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        s = s.masked_fill(~keep, torch.finfo(s.dtype).min)
        y = F.softmax(s, dim=-1) @ v
        y = y.transpose(1, 2).flatten(2)
        return self.post(y)


class Block(nn.Module):
    def __init__(self, d_model, n_head):
        super().__init__()
        self.n1 = nn.LayerNorm(d_model)
        self.f = Mixer(d_model, n_head)
        self.n2 = nn.LayerNorm(d_model)
        self.g = nn.Sequential(
            nn.Linear(d_model, 2 * d_model), nn.SiLU(), nn.Linear(2 * d_model, d_model)
        )

    def forward(self, x):
        x = x + self.f(self.n1(x))
        return x + self.g(self.n2(x))


EXPECT = {
    "target": "Block",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "f",
    "style": "generic names: block.f, in_lin, post, self.nh",
}

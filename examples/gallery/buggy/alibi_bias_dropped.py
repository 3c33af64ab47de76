"""ALiBi attention whose bias is computed and never used: the out-of-place add is dropped."""

import math

import torch
from torch import nn


def geometric_slopes(n):
    def power_of_two(k):
        start = 2 ** (-(2 ** -(math.log2(k) - 3)))
        return [start * start**i for i in range(k)]

    if math.log2(n).is_integer():
        return power_of_two(n)
    low = 2 ** math.floor(math.log2(n))
    return power_of_two(low) + power_of_two(2 * low)[0::2][: n - low]


class AlibiAttention(nn.Module):
    def __init__(self, d_model=36, n_heads=6):
        super().__init__()
        self.h, self.hd = n_heads, d_model // n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.register_buffer("slopes", torch.tensor(geometric_slopes(n_heads)), persistent=False)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.h, self.hd).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.hd)
        pos = torch.arange(n)
        distance = (pos[None, :] - pos[:, None]).float()  # j - i: 0 on the diagonal
        scores.add(self.slopes[:, None, None] * distance)  # bug: result discarded
        future = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)
        scores = scores.masked_fill(future, float("-inf"))
        out = scores.softmax(-1) @ v
        return self.out(out.transpose(1, 2).reshape(b, n, -1))


EXPECT = {
    "target": "AlibiAttention",
    "kind": "causal-multihead",
    "ok": False,
    "stage": "biased_scores",
    "mistake": "bias_missing",
    "init": {"d_model": 36, "n_heads": 6},
}

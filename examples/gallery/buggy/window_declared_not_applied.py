"""A layer whose config declares a sliding window and whose mask is only causal."""

import math
from types import SimpleNamespace

import torch
from torch import nn


class SlidingWindowAttention(nn.Module):
    def __init__(self, config=None):
        super().__init__()
        config = config or SimpleNamespace(hidden_size=32, num_heads=4, sliding_window=3)
        self.config = config
        self.h = config.num_heads
        self.hd = config.hidden_size // config.num_heads
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.k_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden_states):
        b, n, _ = hidden_states.shape
        q, k, v = (
            p(hidden_states).view(b, n, self.h, self.hd).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        i = torch.arange(n)[:, None]
        j = torch.arange(n)[None, :]
        allowed = j <= i  # bug: config.sliding_window never used
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.hd)
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        out = torch.softmax(scores, dim=-1) @ v
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


EXPECT = {
    "target": "SlidingWindowAttention",
    "kind": "causal-multihead",
    "ok": False,
    "stage": "masked_scores",
    "mistake": "window_missing",
}

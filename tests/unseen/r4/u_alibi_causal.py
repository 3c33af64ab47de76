"""GPT-style causal attention with ALiBi (no position embeddings): per-head linear distance penalties with the standard geometric slopes, added to the scaled scores."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def get_alibi_slopes(n_heads):
    def power_of_2_slopes(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * (start**i) for i in range(n)]

    if math.log2(n_heads).is_integer():
        return power_of_2_slopes(n_heads)
    closest = 2 ** math.floor(math.log2(n_heads))
    return power_of_2_slopes(closest) + get_alibi_slopes(2 * closest)[0::2][: n_heads - closest]


class AlibiSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, block_size, dropout=0.0, bias=True):
        super().__init__()
        assert n_embd % n_head == 0
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.attn_dropout = nn.Dropout(dropout)
        self.register_buffer("slopes", torch.tensor(get_alibi_slopes(n_head)), persistent=False)
        pos = torch.arange(block_size)
        self.register_buffer(
            "distance", (pos[None, :] - pos[:, None]).float(), persistent=False
        )  # j - i
        self.register_buffer(
            "tril",
            torch.tril(torch.ones(block_size, block_size, dtype=torch.bool)),
            persistent=False,
        )

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        att = att + self.slopes[:, None, None] * self.distance[:T, :T]  # penalise far-away keys
        att = att.masked_fill(~self.tril[:T, :T], float("-inf"))
        att = self.attn_dropout(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


EXPECT = {
    "target": "AlibiSelfAttention",
    "kind": "causal-multihead",
    "unsupported": "alibi",
    "style": "nanoGPT-like attention with ALiBi biases",
}

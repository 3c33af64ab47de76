"""Causal attention whose core is a module-level @torch.no_grad() helper over heads folded into the batch; dataclass output."""

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class AttentionOutput:
    hidden_states: torch.Tensor
    attention_probs: torch.Tensor | None = None


@torch.no_grad()
def _attend(q, k, v, additive_mask):
    """q, k, v: (batch*heads, tokens, head_dim); additive_mask: (tokens, tokens) of 0 / -inf."""
    scores = torch.baddbmm(additive_mask, q, k.transpose(1, 2), alpha=q.size(-1) ** -0.5)
    probs = torch.softmax(scores, dim=-1)
    return torch.bmm(probs, v), probs


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, block_size=64, bias=True):
        super().__init__()
        assert n_embd % n_head == 0
        self.n_head = n_head
        self.head_dim = n_embd // n_head
        self.wq = nn.Linear(n_embd, n_embd, bias=bias)
        self.wk = nn.Linear(n_embd, n_embd, bias=bias)
        self.wv = nn.Linear(n_embd, n_embd, bias=bias)
        self.wo = nn.Linear(n_embd, n_embd, bias=bias)
        future = torch.full((block_size, block_size), float("-inf")).triu(1)
        self.register_buffer("future", future, persistent=False)

    def forward(self, x):
        B, T, C = x.size()

        def fold(t):
            return (
                t.view(B, T, self.n_head, self.head_dim)
                .transpose(1, 2)
                .reshape(B * self.n_head, T, self.head_dim)
            )

        ctx, probs = _attend(
            fold(self.wq(x)), fold(self.wk(x)), fold(self.wv(x)), self.future[:T, :T]
        )
        ctx = ctx.view(B, self.n_head, T, self.head_dim).transpose(1, 2).reshape(B, T, C)
        return AttentionOutput(
            hidden_states=self.wo(ctx), attention_probs=probs.view(B, self.n_head, T, T)
        )


EXPECT = {
    "target": "CausalSelfAttention",
    "kind": "causal-multihead",
    "ok": True,
    "style": "module-level @torch.no_grad() helper (baddbmm with additive -inf mask), heads folded into batch, dataclass output",
}

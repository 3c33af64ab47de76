"""Mistral-style sliding-window causal attention (rotary left out): each token sees itself and the 3 tokens before it, mask passed to SDPA."""

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn


def sliding_window_causal_mask(q_len, window, device=None):
    """Boolean (q_len, q_len) mask, True where key j is visible from query i."""
    i = torch.arange(q_len, device=device)[:, None]
    j = torch.arange(q_len, device=device)[None, :]
    return (j <= i) & (i - j < window)


class SlidingWindowAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.sliding_window = config.sliding_window
        self.q_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=False)
        self.k_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=False)
        self.v_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=False)
        self.o_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask=None):
        bsz, q_len, _ = hidden_states.shape
        q = (
            self.q_proj(hidden_states)
            .view(bsz, q_len, self.num_heads, self.head_dim)
            .transpose(1, 2)
        )
        k = (
            self.k_proj(hidden_states)
            .view(bsz, q_len, self.num_heads, self.head_dim)
            .transpose(1, 2)
        )
        v = (
            self.v_proj(hidden_states)
            .view(bsz, q_len, self.num_heads, self.head_dim)
            .transpose(1, 2)
        )
        if attention_mask is None:
            attention_mask = sliding_window_causal_mask(
                q_len, self.sliding_window, hidden_states.device
            )
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        out = out.transpose(1, 2).reshape(bsz, q_len, self.hidden_size)
        return self.o_proj(out)


def make_window_attention():
    config = SimpleNamespace(hidden_size=24, num_attention_heads=4, sliding_window=4)
    return SlidingWindowAttention(config)


EXPECT = {
    "target": "make_window_attention",
    "kind": "causal-multihead",
    "unsupported": "window",
    "style": "Mistral-style sliding window (window 4, no RoPE)",
}

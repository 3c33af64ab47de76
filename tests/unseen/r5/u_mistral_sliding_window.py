"""Mistral-style attention with a sliding window of 4 keys (rotary omitted to keep only the window), eager path."""

from types import SimpleNamespace

import torch
from torch import nn


def sliding_window_causal_mask(seq_len, window, dtype, device=None):
    i = torch.arange(seq_len, device=device)[:, None]
    j = torch.arange(seq_len, device=device)[None, :]
    allowed = (j <= i) & (j > i - window)
    mask = torch.zeros(seq_len, seq_len, dtype=dtype, device=device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)


class MistralAttention(nn.Module):
    def __init__(self, config, layer_idx=0):
        super().__init__()
        self.config = config
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.num_heads = config.num_attention_heads
        self.scaling = self.head_dim**-0.5
        self.sliding_window = config.sliding_window
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask=None):
        bsz, q_len, _ = hidden_states.shape
        hidden_shape = (bsz, q_len, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        if attention_mask is None:
            attention_mask = sliding_window_causal_mask(
                q_len, self.sliding_window, q.dtype, q.device
            )
        attn_weights = torch.matmul(q, k.transpose(2, 3)) * self.scaling
        attn_weights = attn_weights + attention_mask
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(q.dtype)
        attn_output = torch.matmul(attn_weights, v).transpose(1, 2).reshape(bsz, q_len, -1)
        return self.o_proj(attn_output), attn_weights


def make_attention():
    return MistralAttention(
        SimpleNamespace(hidden_size=24, num_attention_heads=4, sliding_window=4)
    )


EXPECT = {
    "target": "make_attention",
    "kind": "causal-multihead",
    "unsupported": "window",
    "style": "Mistral attention with config.sliding_window=4 (mask j in (i-4, i]), no rotary",
}

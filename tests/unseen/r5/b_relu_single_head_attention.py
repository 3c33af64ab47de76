"""Single-head self-attention with raw Parameter weights (x @ W_query, LLMs-from-scratch v1 style, batched); bug: ReLU of the scaled scores used as the weights."""

import torch
import torch.nn as nn


class SelfAttention_v1(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.W_query = nn.Parameter(torch.randn(d_in, d_out) * d_in**-0.5)
        self.W_key = nn.Parameter(torch.randn(d_in, d_out) * d_in**-0.5)
        self.W_value = nn.Parameter(torch.randn(d_in, d_out) * d_in**-0.5)

    def forward(self, x):
        keys = x @ self.W_key
        queries = x @ self.W_query
        values = x @ self.W_value
        attn_scores = queries @ keys.transpose(-2, -1)
        # "ReLU attention": cheaper than a softmax
        attn_weights = torch.relu(attn_scores / keys.shape[-1] ** 0.5)
        return attn_weights @ values


EXPECT = {
    "target": "SelfAttention_v1",
    "kind": "self",
    "ok": False,
    "stage": "weights",
    "mistake": "not_softmax",
    "style": "LLMs-from-scratch SelfAttention_v1 adapted to batches (nn.Parameter (d_in, d_out) weights; ReLU instead of softmax)",
}

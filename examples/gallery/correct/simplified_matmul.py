"""Simplified (weightless) self-attention with matmuls; (tokens, d) or (batch, tokens, d)."""

import torch


def simplified_attention(inputs):
    attn_scores = inputs @ inputs.transpose(-2, -1)
    attn_weights = torch.softmax(attn_scores, dim=-1)
    return attn_weights @ inputs


EXPECT = {"target": "simplified_attention", "kind": "simplified", "ok": True}

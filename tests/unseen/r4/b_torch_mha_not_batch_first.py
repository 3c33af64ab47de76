"""Encoder block around nn.MultiheadAttention left at batch_first=False but fed (batch, tokens, d): attention runs across the batch instead of the tokens."""

import torch.nn as nn


class EncoderBlock(nn.Module):
    def __init__(self, d_model, num_heads, dropout=0.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = nn.MultiheadAttention(d_model, num_heads, dropout=dropout)
        self.norm2 = nn.LayerNorm(d_model)
        self.ff = nn.Sequential(
            nn.Linear(d_model, 2 * d_model), nn.ReLU(), nn.Linear(2 * d_model, d_model)
        )

    def forward(self, x, key_padding_mask=None):
        # x: (batch, tokens, d_model)
        h = self.norm1(x)
        a, _ = self.attn(h, h, h, key_padding_mask=key_padding_mask, need_weights=False)
        x = x + a
        return x + self.ff(self.norm2(x))


EXPECT = {
    "target": "EncoderBlock",
    "kind": "multihead",
    "ok": False,
    "stage": "scores",
    "mistake": "batch_mixing",
    "layer": "attn",
    "style": "block around nn.MultiheadAttention (default batch_first=False)",
}

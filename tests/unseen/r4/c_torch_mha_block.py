"""PyTorch-tutorial-style decoder block around nn.MultiheadAttention(batch_first=True) with a square subsequent mask."""

import torch.nn as nn


class DecoderBlock(nn.Module):
    def __init__(self, d_model, num_heads, dropout=0.0, block_size=64):
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = nn.MultiheadAttention(d_model, num_heads, dropout=dropout, batch_first=True)
        self.norm2 = nn.LayerNorm(d_model)
        self.ff = nn.Sequential(
            nn.Linear(d_model, 4 * d_model),
            nn.GELU(),
            nn.Linear(4 * d_model, d_model),
            nn.Dropout(dropout),
        )
        self.block_size = block_size

    def forward(self, x):
        T = x.size(1)
        causal = nn.Transformer.generate_square_subsequent_mask(T, device=x.device, dtype=x.dtype)
        h = self.norm1(x)
        attn_out, _ = self.attn(h, h, h, attn_mask=causal, need_weights=False)
        x = x + attn_out
        x = x + self.ff(self.norm2(x))
        return x


EXPECT = {
    "target": "DecoderBlock",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "attn",
    "style": "PyTorch tutorial block around nn.MultiheadAttention(batch_first=True)",
}

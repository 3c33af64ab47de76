"""Token mixer around nn.MultiheadAttention; bug: batch_first left at False while the input is (batch, tokens, dim)."""

from torch import nn


class TokenMixer(nn.Module):
    def __init__(self, dim, num_heads, dropout=0.0):
        super().__init__()
        self.norm = nn.Identity()
        self.attn = nn.MultiheadAttention(dim, num_heads, dropout=dropout)

    def forward(self, x):
        # x: (batch, tokens, dim)
        h = self.norm(x)
        out, _ = self.attn(h, h, h, need_weights=False)
        return out


EXPECT = {
    "target": "TokenMixer",
    "kind": "multihead",
    "ok": False,
    "stage": "scores",
    "mistake": "batch_mixing",
    "layer": "attn",
    "style": "nn.MultiheadAttention used without batch_first=True on batch-first input (tokens at one position attend across the batch)",
}

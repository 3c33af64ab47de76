"""PyTorch's own nn.TransformerEncoderLayer (batch_first=True, post-norm) used as the block."""

from torch import nn


def make_block():
    return nn.TransformerEncoderLayer(
        d_model=20, nhead=4, dim_feedforward=48, dropout=0.0, batch_first=True, norm_first=False
    )


EXPECT = {
    "target": "make_block",
    "kind": "multihead",
    "ok": True,
    "layer": "self_attn",
    "style": "torch.nn.TransformerEncoderLayer(batch_first=True) as a block (fast path in eval)",
}

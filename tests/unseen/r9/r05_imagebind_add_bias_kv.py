"""ImageBind (facebookresearch/ImageBind, models/transformer.py) BlockWithMasking whose
attention is torch.nn.MultiheadAttention(..., add_bias_kv=True), as ImageBind builds it for
its audio, depth, thermal and IMU trunks.

add_bias_kv appends one learned key (bias_k) and one learned value (bias_v) to every
sequence, so each query also attends to a token that is not in the input: a learned
extra key/value slot outside the vocabulary. SimpleTransformer runs sequence-first
(tokens.transpose(0, 1)), so the layer sees (tokens, batch, d).
"""

import torch
from torch import nn


class BlockWithMasking(nn.Module):
    def __init__(
        self, dim, attn_target, mlp_ratio=2, layer_scale_type=None, layer_scale_init_value=1e-4
    ):
        super().__init__()
        self.attn = attn_target()
        self.norm_1 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(
            nn.Linear(dim, mlp_ratio * dim), nn.GELU(), nn.Linear(mlp_ratio * dim, dim)
        )
        self.norm_2 = nn.LayerNorm(dim, eps=1e-6)
        self.layer_scale_type = layer_scale_type

    def forward(self, x, attn_mask=None):
        x = (
            x
            + self.attn(
                self.norm_1(x),
                self.norm_1(x),
                self.norm_1(x),
                need_weights=False,
                attn_mask=attn_mask,
            )[0]
        )
        return x + self.mlp(self.norm_2(x))


class SimpleTransformer(nn.Module):
    def __init__(self, embed_dim=64, num_heads=4, num_blocks=1):
        super().__init__()
        self.blocks = nn.Sequential(
            *[
                BlockWithMasking(
                    embed_dim,
                    attn_target=lambda: nn.MultiheadAttention(
                        embed_dim, num_heads, bias=True, add_bias_kv=True
                    ),
                )
                for _ in range(num_blocks)
            ]
        )

    def forward(self, tokens):
        tokens = tokens.transpose(0, 1)  # B, L, D -> L, B, D
        for blk in self.blocks:
            tokens = blk(tokens)
        return tokens.transpose(0, 1)


def make_imagebind_trunk():
    torch.manual_seed(205)
    trunk = SimpleTransformer()
    with torch.no_grad():
        blk = trunk.blocks[0]
        for ln in (blk.norm_1, blk.norm_2):
            ln.weight.uniform_(0.5, 1.5)
            ln.bias.uniform_(-0.1, 0.1)
        blk.attn.in_proj_bias.uniform_(-0.1, 0.1)
        blk.attn.bias_k.normal_(0.0, 1.0)
        blk.attn.bias_v.normal_(0.0, 1.0)
    return trunk.eval()


EXPECT = {
    "target": "make_imagebind_trunk",
    "kind": "multihead",
    "ok": True,
    "layer": "blocks.0.attn",
    "unsupported": "bias_kv",
    "style": "ImageBind SimpleTransformer/BlockWithMasking (sequence-first) with nn.MultiheadAttention(add_bias_kv=True): "
    "a learned bias_k/bias_v token appended to every sequence's keys and values",
}

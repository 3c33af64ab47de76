"""Segment Anything (facebookresearch/segment-anything) two-way transformer cross-attention: the
`Attention` class with downsample_rate (q/k/v project embedding_dim -> internal_dim =
embedding_dim // downsample_rate, with bias), _separate_heads / _recombine_heads helpers,
attn = q @ k.permute(0, 1, 3, 2) / sqrt(c_per_head), softmax, out_proj back to embedding_dim.
The target is the token-to-image step of a TwoWayAttentionBlock: queries (prompt tokens) attend to
keys (image tokens), then residual and LayerNorm. Positional encodings (query_pe / key_pe) are left
out.

This file: correct (8 heads of 8, downsample_rate 1)."""

import math

import torch
from torch import nn


class Attention(nn.Module):
    def __init__(self, embedding_dim, num_heads, downsample_rate=1):
        super().__init__()
        self.embedding_dim = embedding_dim
        self.internal_dim = embedding_dim // downsample_rate
        self.num_heads = num_heads
        assert self.internal_dim % num_heads == 0, "num_heads must divide embedding_dim."
        self.q_proj = nn.Linear(embedding_dim, self.internal_dim)
        self.k_proj = nn.Linear(embedding_dim, self.internal_dim)
        self.v_proj = nn.Linear(embedding_dim, self.internal_dim)
        self.out_proj = nn.Linear(self.internal_dim, embedding_dim)

    def _separate_heads(self, x, num_heads):
        b, n, c = x.shape
        x = x.reshape(b, n, num_heads, c // num_heads)
        return x.transpose(1, 2)

    def _recombine_heads(self, x):
        b, n_heads, n_tokens, c_per_head = x.shape
        x = x.transpose(1, 2)
        return x.reshape(b, n_tokens, n_heads * c_per_head)

    def forward(self, q, k, v):
        q = self.q_proj(q)
        k = self.k_proj(k)
        v = self.v_proj(v)

        q = self._separate_heads(q, self.num_heads)
        k = self._separate_heads(k, self.num_heads)
        v = self._separate_heads(v, self.num_heads)

        _, _, _, c_per_head = q.shape
        attn = q @ k.permute(0, 1, 3, 2)
        attn = attn / math.sqrt(c_per_head)
        attn = torch.softmax(attn, dim=-1)

        out = attn @ v
        out = self._recombine_heads(out)
        out = self.out_proj(out)
        return out


class TokenToImageBlock(nn.Module):
    def __init__(self, embedding_dim=64, num_heads=8, attention_downsample_rate=1):
        super().__init__()
        self.cross_attn_token_to_image = Attention(
            embedding_dim, num_heads, downsample_rate=attention_downsample_rate
        )
        self.norm2 = nn.LayerNorm(embedding_dim)

    def forward(self, queries, keys):
        attn_out = self.cross_attn_token_to_image(q=queries, k=keys, v=keys)
        queries = queries + attn_out
        return self.norm2(queries)


def make_sam_token_to_image():
    torch.manual_seed(2107)
    block = TokenToImageBlock()
    with torch.no_grad():
        block.norm2.weight.uniform_(0.5, 1.5)
        block.norm2.bias.uniform_(-0.2, 0.2)
    return block.eval()


EXPECT = {
    "target": "make_sam_token_to_image",
    "kind": "cross",
    "ok": True,
    "layer": "cross_attn_token_to_image",
    "structure": {
        "heads": 8,
        "kv_heads": 8,
        "head_dim": 8,
        "causal": False,
        "cross": True,
        "rope": None,
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": 'SAM two-way transformer Attention, token-to-image cross-attention: correct',
}

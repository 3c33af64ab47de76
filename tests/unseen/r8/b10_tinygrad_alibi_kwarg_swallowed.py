"""tinygrad-style port (plain tensor ops, combined c_attn) of an ALiBi causal decoder
block with 5 heads (non-power-of-two slopes: the 4-head sequence plus the 8-head
sequence's first even entry).  The block builds the ALiBi tensor and passes it as
`alibi=`, but the attention's forward names the argument `attn_bias` and swallows
unknown keywords in **kwargs, so the bias is never added.
"""

import math

import torch
from torch import nn


def get_alibi_slopes(n_heads):
    def p2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(n_heads).is_integer():
        return p2(n_heads)
    c = 2 ** math.floor(math.log2(n_heads))
    return p2(c) + p2(2 * c)[0::2][: n_heads - c]


class Attention(nn.Module):
    def __init__(self, dim=80, n_heads=5):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.c_attn = nn.Linear(dim, 3 * dim, bias=True)
        self.c_proj = nn.Linear(dim, dim, bias=True)

    def forward(self, x, mask, attn_bias=None, **kwargs):
        b, t, c = x.shape
        xq, xk, xv = [
            y.reshape(b, t, self.n_heads, self.head_dim).permute(0, 2, 1, 3)
            for y in self.c_attn(x).chunk(3, dim=2)
        ]
        scores = xq.matmul(xk.transpose(-1, -2)) / math.sqrt(self.head_dim)
        if attn_bias is not None:
            scores = scores + attn_bias
        scores = scores + mask
        out = scores.softmax(-1).matmul(xv).permute(0, 2, 1, 3).reshape(b, t, c)
        return self.c_proj(out)


class TransformerBlock(nn.Module):
    def __init__(self, dim=80, n_heads=5):
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim, eps=1e-5)
        self.attn = Attention(dim, n_heads)
        self.register_buffer("slopes", torch.tensor(get_alibi_slopes(n_heads)), persistent=False)

    def forward(self, x):
        t = x.shape[1]
        mask = torch.full((1, 1, t, t), float("-inf"), dtype=x.dtype).triu(1)
        pos = torch.arange(t, dtype=x.dtype)
        rel = pos[None, :] - pos[:, None]  # j - i (<= 0 where visible)
        alibi = self.slopes.to(x.dtype)[None, :, None, None] * rel[None, None]
        return x + self.attn(self.ln_1(x), mask, alibi=alibi)


def make_tinygrad_block():
    torch.manual_seed(110)
    blk = TransformerBlock()
    with torch.no_grad():
        blk.ln_1.weight.uniform_(0.5, 1.5)
    return blk


EXPECT = {
    "target": "make_tinygrad_block",
    "kind": "causal-multihead",
    "ok": False,
    "layer": "attn",
    "stage": "biased_scores",
    "mistake": "bias_missing",
    "style": "tinygrad-style GPT port (fused c_attn chunk(3), 5 ALiBi heads, slope*(j-i) form): the block passes "
    "alibi= but the layer's parameter is attn_bias and **kwargs swallows it, so no bias is added",
}

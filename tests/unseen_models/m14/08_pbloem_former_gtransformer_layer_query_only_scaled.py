"""Peter Bloem's `former` (pbloem/former, former/transformers.py + modules.py) GTransformer, reduced.

GTransformer: token_embedding, pos_embedding (learned, nn.Embedding), tblocks (nn.Sequential of
TransformerBlock), toprobs.  TransformerBlock is post-norm: x = norm1(attention(x) + x); x =
norm2(ff(x) + x), ff = Linear, ReLU, Linear.  SelfAttention (narrow heads): tokeys/toqueries/tovalues
(no bias), heads cut from the embedding (s = e // h), folded to (b*h, t, s), queries and keys each
divided by s ** (1/4) (together 1/sqrt(s)), torch.bmm, `mask_` fills above the diagonal with -inf,
softmax over dim 2, bmm with values, unifyheads.
Slip: block 1's SelfAttention was edited to "scale once" and only divides the queries by s ** (1/4):
its scores are scaled by s^-1/4 instead of s^-1/2.  No cache.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": [
        "tblocks.0.attention",
        "tblocks.1.attention",
        "tblocks.2.attention",
    ],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "tblocks.1.attention",
    "stage": "scaled_scores",
    "mistake": "wrong_scale",
    "style": "pbloem/former GTransformer: nn.Sequential tblocks, post-norm, tokeys/toqueries/tovalues/unifyheads, "
    "(b*h) bmm with q and k each / s**(1/4), mask_ -inf; block 1 divides only the queries (s^-1/4)",
}


def mask_(matrices, maskval=0.0, mask_diagonal=True):
    h, w = matrices.size(-2), matrices.size(-1)
    indices = torch.triu_indices(h, w, offset=0 if mask_diagonal else 1)
    matrices[..., indices[0], indices[1]] = maskval


class SelfAttention(nn.Module):
    def __init__(self, emb, heads=4, mask=False, scale_once=False):
        super().__init__()
        assert emb % heads == 0
        self.emb = emb
        self.heads = heads
        self.mask = mask
        self.scale_once = scale_once
        self.tokeys = nn.Linear(emb, emb, bias=False)
        self.toqueries = nn.Linear(emb, emb, bias=False)
        self.tovalues = nn.Linear(emb, emb, bias=False)
        self.unifyheads = nn.Linear(emb, emb)

    def forward(self, x):
        b, t, e = x.size()
        h = self.heads
        s = e // h
        keys = self.tokeys(x).view(b, t, h, s)
        queries = self.toqueries(x).view(b, t, h, s)
        values = self.tovalues(x).view(b, t, h, s)
        keys = keys.transpose(1, 2).contiguous().view(b * h, t, s)
        queries = queries.transpose(1, 2).contiguous().view(b * h, t, s)
        values = values.transpose(1, 2).contiguous().view(b * h, t, s)
        queries = queries / (s ** (1 / 4))
        if not self.scale_once:
            keys = keys / (s ** (1 / 4))
        dot = torch.bmm(queries, keys.transpose(1, 2))
        if self.mask:
            mask_(dot, maskval=float("-inf"), mask_diagonal=False)
        dot = F.softmax(dot, dim=2)
        out = torch.bmm(dot, values).view(b, h, t, s)
        out = out.transpose(1, 2).contiguous().view(b, t, s * h)
        return self.unifyheads(out)


class TransformerBlock(nn.Module):
    def __init__(self, emb, heads, mask, ff_hidden_mult=2, scale_once=False):
        super().__init__()
        self.attention = SelfAttention(emb, heads=heads, mask=mask, scale_once=scale_once)
        self.norm1 = nn.LayerNorm(emb)
        self.norm2 = nn.LayerNorm(emb)
        self.ff = nn.Sequential(nn.Linear(emb, ff_hidden_mult * emb), nn.ReLU(), nn.Linear(ff_hidden_mult * emb, emb))

    def forward(self, x):
        attended = self.attention(x)
        x = self.norm1(attended + x)
        fedforward = self.ff(x)
        return self.norm2(fedforward + x)


class GTransformer(nn.Module):
    def __init__(self, emb, heads, depth, seq_length, num_tokens, scale_once_blocks=()):
        super().__init__()
        self.num_tokens = num_tokens
        self.token_embedding = nn.Embedding(num_embeddings=num_tokens, embedding_dim=emb)
        self.pos_embedding = nn.Embedding(num_embeddings=seq_length, embedding_dim=emb)
        tblocks = [TransformerBlock(emb=emb, heads=heads, mask=True, scale_once=(i in scale_once_blocks))
                   for i in range(depth)]
        self.tblocks = nn.Sequential(*tblocks)
        self.toprobs = nn.Linear(emb, num_tokens)

    def forward(self, x):
        tokens = self.token_embedding(x)
        b, t, e = tokens.size()
        positions = self.pos_embedding(torch.arange(t))[None, :, :].expand(b, t, e)
        x = tokens + positions
        x = self.tblocks(x)
        return self.toprobs(x.view(b * t, e)).view(b, t, self.num_tokens)


def make_model():
    torch.manual_seed(1408)
    model = GTransformer(emb=64, heads=4, depth=3, seq_length=64, num_tokens=96, scale_once_blocks=(1,))
    g = torch.Generator().manual_seed(14081)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model.eval()

"""Point-E (openai/point-e, point_e/models/transformer.py and perceiver.py) point-cloud transformer:
`c_qkv` fused projection whose output is viewed per head as [q | k | v] (attn_ch each), the
1/sqrt(sqrt(attn_ch)) factor applied to q and to k, einsum scores "bthc,bshc->bhts", softmax in at
least float32, einsum context back to (batch, tokens, heads, attn_ch), `c_proj`. Pre-LayerNorm
residual blocks, bidirectional (points have no order).

This file: correct: perceiver cross-attention block, 4 heads of 16; c_kv viewed per head [k|v]."""

import math

import torch
from torch import nn


def _softmax_dtype(dtype):
    return torch.promote_types(dtype, torch.float32)


class QKVMultiheadAttention(nn.Module):
    def __init__(self, *, heads, n_ctx):
        super().__init__()
        self.heads = heads
        self.n_ctx = n_ctx

    def forward(self, qkv):
        bs, n_ctx, width = qkv.shape
        attn_ch = width // self.heads // 3
        scale = 1 / math.sqrt(math.sqrt(attn_ch))
        qkv = qkv.view(bs, n_ctx, self.heads, -1)
        q, k, v = torch.split(qkv, attn_ch, dim=-1)
        weight = torch.einsum("bthc,bshc->bhts", q * scale, k * scale)
        wdtype = weight.dtype
        weight = torch.softmax(weight.to(_softmax_dtype(wdtype)), dim=-1).type(wdtype)
        out = torch.einsum("bhts,bshc->bthc", weight, v).reshape(bs, n_ctx, -1)
        return out


class MultiheadAttention(nn.Module):
    def __init__(self, *, n_ctx, width, heads):
        super().__init__()
        self.n_ctx = n_ctx
        self.width = width
        self.heads = heads
        self.c_qkv = nn.Linear(width, width * 3)
        self.c_proj = nn.Linear(width, width)
        self.attention = QKVMultiheadAttention(heads=heads, n_ctx=n_ctx)

    def forward(self, x):
        x = self.c_qkv(x)
        x = self.attention(x)
        x = self.c_proj(x)
        return x


class QKVMultiheadCrossAttention(nn.Module):
    def __init__(self, *, heads, n_data=None):
        super().__init__()
        self.heads = heads
        self.n_data = n_data

    def forward(self, q, kv):
        _, n_ctx, _ = q.shape
        bs, n_data, width = kv.shape
        attn_ch = width // self.heads // 2
        scale = 1 / math.sqrt(math.sqrt(attn_ch))
        q = q.view(bs, n_ctx, self.heads, -1)
        kv = kv.view(bs, n_data, self.heads, -1)
        k, v = torch.split(kv, attn_ch, dim=-1)
        weight = torch.einsum("bthc,bshc->bhts", q * scale, k * scale)
        wdtype = weight.dtype
        weight = torch.softmax(weight.to(_softmax_dtype(wdtype)), dim=-1).type(wdtype)
        return torch.einsum("bhts,bshc->bthc", weight, v).reshape(bs, n_ctx, -1)


class MultiheadCrossAttention(nn.Module):
    def __init__(self, *, width, heads, data_width=None, n_data=None):
        super().__init__()
        self.width = width
        self.heads = heads
        self.data_width = width if data_width is None else data_width
        self.c_q = nn.Linear(width, width)
        self.c_kv = nn.Linear(self.data_width, width * 2)
        self.c_proj = nn.Linear(width, width)
        self.attention = QKVMultiheadCrossAttention(heads=heads, n_data=n_data)

    def forward(self, x, data):
        x = self.c_q(x)
        data = self.c_kv(data)
        x = self.attention(x, data)
        x = self.c_proj(x)
        return x


class MLP(nn.Module):
    def __init__(self, *, width):
        super().__init__()
        self.c_fc = nn.Linear(width, width * 4)
        self.c_proj = nn.Linear(width * 4, width)
        self.gelu = nn.GELU()

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class ResidualAttentionBlock(nn.Module):
    def __init__(self, *, n_ctx, width, heads):
        super().__init__()
        self.attn = MultiheadAttention(n_ctx=n_ctx, width=width, heads=heads)
        self.ln_1 = nn.LayerNorm(width)
        self.mlp = MLP(width=width)
        self.ln_2 = nn.LayerNorm(width)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Transformer(nn.Module):
    def __init__(self, *, n_ctx, width, layers, heads):
        super().__init__()
        self.n_ctx = n_ctx
        self.width = width
        self.resblocks = nn.ModuleList(
            [ResidualAttentionBlock(n_ctx=n_ctx, width=width, heads=heads) for _ in range(layers)]
        )

    def forward(self, x):
        for block in self.resblocks:
            x = block(x)
        return x


class ResidualCrossAttentionBlock(nn.Module):
    """perceiver.py's block: latents (or points) attend to a conditioning sequence."""

    def __init__(self, *, width, heads, data_width=None):
        super().__init__()
        data_width = width if data_width is None else data_width
        self.attn = MultiheadCrossAttention(width=width, heads=heads, data_width=data_width)
        self.ln_1 = nn.LayerNorm(width)
        self.ln_2 = nn.LayerNorm(data_width)
        self.mlp = MLP(width=width)
        self.ln_3 = nn.LayerNorm(width)

    def forward(self, x, data):
        x = x + self.attn(self.ln_1(x), self.ln_2(data))
        return x + self.mlp(self.ln_3(x))


def _init(model, seed_std=0.25):
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.Linear):
                mod.weight.normal_(0.0, seed_std)
                mod.bias.uniform_(-0.2, 0.2)
            elif isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
    return model


def make_pointe_cross_block():
    torch.manual_seed(4207)
    model = ResidualCrossAttentionBlock(width=64, heads=4)
    return _init(model).eval()


EXPECT = {
    "target": "make_pointe_cross_block",
    "kind": "cross",
    "ok": True,
    "layer": "attn",
    "structure": {
        "heads": 4,
        "kv_heads": 4,
        "head_dim": 16,
        "causal": False,
        "cross": True,
        "rope": None,
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "Point-E (c07_pointe_perceiver_cross): correct: perceiver.py "
    "ResidualCrossAttentionBlock: c_q on the stream, c_kv on ln_2(data) viewed per head "
    "[k|v], 4 heads of 16, any data length",
}

"""ViT-22B style encoder ported from Flax to torch: parallel layer (one LayerNorm feeding attention and
MLP), q/k/v as DenseGeneral kernels (width, heads, head_dim) applied by einsum 'btd,dhk->bthk' with
bias, bias-free LayerNorm on each head's queries and keys (the QK-layernorm of ViT-22B), q scaled by
head_dim**-0.5 before einsum 'bqhd,bkhd->bhqk', softmax, einsum 'bhqk,bkhd->bqhd', DenseGeneral out
'bthk,hkd->btd'.

This file: bug. The bmm rewrite folds the queries (batch, heads) but the keys (heads, batch), so
at batch >= 2 a query meets another sequence's keys."""

import torch
import torch.nn.functional as F
from torch import nn


class DenseGeneral(nn.Module):
    """Flax DenseGeneral ported to torch: a kernel shaped (in..., out...) applied by einsum."""

    def __init__(self, kernel_shape, equation, bias_shape=None):
        super().__init__()
        self.equation = equation
        self.kernel = nn.Parameter(torch.randn(*kernel_shape) * kernel_shape[0] ** -0.5)
        self.bias = (
            nn.Parameter(torch.randn(*bias_shape) * 0.02) if bias_shape is not None else None
        )

    def forward(self, x):
        y = torch.einsum(self.equation, x, self.kernel.to(x.dtype))
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y


class QKLayerNormAttention(nn.Module):
    """ViT-22B attention: q/k/v as DenseGeneral (width -> heads x head_dim), LayerNorm (no bias)
    on each head's queries and keys, einsum attention with q pre-scaled, DenseGeneral out."""

    def __init__(self, width=64, num_heads=4):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = width // num_heads
        self.query = DenseGeneral(
            (width, num_heads, self.head_dim), "btd,dhk->bthk", (num_heads, self.head_dim)
        )
        self.key = DenseGeneral(
            (width, num_heads, self.head_dim), "btd,dhk->bthk", (num_heads, self.head_dim)
        )
        self.value = DenseGeneral(
            (width, num_heads, self.head_dim), "btd,dhk->bthk", (num_heads, self.head_dim)
        )
        self.out = DenseGeneral((num_heads, self.head_dim, width), "bthk,hkd->btd", (width,))
        self.query_ln = nn.LayerNorm(self.head_dim, bias=False)
        self.key_ln = nn.LayerNorm(self.head_dim, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.query_ln(self.query(x))
        k = self.key_ln(self.key(x))
        v = self.value(x)
        q = q * self.head_dim**-0.5
        # bmm path (export friendly): fold (batch, heads)
        qf = q.permute(0, 2, 1, 3).reshape(b * self.num_heads, t, self.head_dim)
        kf = k.permute(2, 0, 1, 3).reshape(b * self.num_heads, t, self.head_dim)
        logits = torch.bmm(qf, kf.transpose(1, 2)).view(b, self.num_heads, t, t)
        weights = F.softmax(logits, dim=-1)
        ctx = torch.einsum("bhqk,bkhd->bqhd", weights, v)
        return self.out(ctx)


class ParallelBlock(nn.Module):
    """ViT-22B parallel layer: one LayerNorm feeds both the attention and the MLP branch."""

    def __init__(self, width=64, num_heads=4, mlp_dim=128):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.attn = QKLayerNormAttention(width, num_heads)
        self.mlp_in = nn.Linear(width, mlp_dim)
        self.mlp_out = nn.Linear(mlp_dim, width)

    def forward(self, x):
        y = self.norm(x)
        return x + self.attn(y) + self.mlp_out(F.gelu(self.mlp_in(y)))


class Encoder(nn.Module):
    def __init__(self, depth=1, width=64, num_heads=4):
        super().__init__()
        self.pos_embedding = nn.Parameter(torch.randn(1, 128, width) * 0.02)
        self.blocks = nn.ModuleList([ParallelBlock(width, num_heads) for _ in range(depth)])
        self.encoder_norm = nn.LayerNorm(width)

    def forward(self, x):
        x = x + self.pos_embedding[:, : x.shape[1]].to(x.dtype)
        for blk in self.blocks:
            x = blk(x)
        return self.encoder_norm(x)


def make_vit22b():
    torch.manual_seed(1339)
    model = Encoder()
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                if mod.bias is not None:
                    mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {
    "target": "make_vit22b",
    "kind": "multihead",
    "ok": False,
    "layer": "blocks.0.attn",
    "stage": "scores",
    "mistake": "batch_mixing",
    "style": "ViT-22B port, bmm rewrite: keys folded permute(2, 0, 1, 3) (heads-major), queries "
    "batch-major",
}

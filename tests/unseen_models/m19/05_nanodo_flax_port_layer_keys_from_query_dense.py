"""google-deepmind/nanodo's decoder-only model (nanodo/model.py, TransformerDo) ported from Flax to
PyTorch module by module.

TransformerDo: embed (token nn.Embed), pos_embed (learned absolute positions), blocks.N (TBlock:
ln1 -> attn -> + residual, ln2 -> mlp -> + residual), out_ln, and a logits head that re-uses the token
embedding (embed.attend).  CausalAttn: `query`/`key`/`value` are DenseGeneral layers with a Flax kernel
(D, N, H) (features=(N, H), no bias), q is divided by sqrt(H), logits einsum '...qhd,...khd->...hqk',
causal tril mask applied with jnp.where(mask, logits, finfo.min), softmax, einsum
'...hqk,...khd->...qhd', and `attn_out_proj`, a DenseGeneral over axes (-2, -1) with kernel (N, H, D).
Mlp: fc1 / gelu / fc2.  LayerNorms with scale and bias.  MHA 4 x 16, 3 blocks.
Slip: block 1 was built as a `CausalAttnSharedQK` (a shared-QK experiment in the style of Reformer,
left switched on in one block of the config): its keys are computed with the `query` kernel, although
the block still owns (and ignores) its `key` kernel.
No cache.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": [
        "blocks.0.attn",
        "blocks.1.attn",
        "blocks.2.attn",
    ],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "blocks.1.attn",
    "stage": "keys",
    "mistake": "wrong_projection",
    "style": "nanodo TransformerDo ported from Flax: DenseGeneral kernels (D, N, H) and (N, H, D) via einsum, "
    "learned pos_embed, embed.attend tied logits, where(tril, logits, finfo.min); block 1's shared-QK "
    "variant projects the keys with the query kernel",
}


class DenseGeneral(nn.Module):
    """flax.linen.DenseGeneral without bias: kernel of shape in_shape + out_shape."""

    def __init__(self, in_shape, out_shape):
        super().__init__()
        fan_in = math.prod(in_shape)
        self.kernel = nn.Parameter(torch.randn(*in_shape, *out_shape) / math.sqrt(fan_in))
        self.n_in = len(in_shape)

    def forward(self, x):
        dims = list(range(x.dim() - self.n_in, x.dim()))
        return torch.tensordot(x, self.kernel, dims=(dims, list(range(self.n_in))))


class LayerNorm(nn.Module):
    def __init__(self, dim, epsilon=1e-6):
        super().__init__()
        self.epsilon = epsilon
        self.scale = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        var = x.var(-1, keepdim=True, unbiased=False)
        return (x - mean) * torch.rsqrt(var + self.epsilon) * self.scale + self.bias


class CausalAttn(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.N = cfg.N
        self.H = cfg.D // cfg.N
        self.query = DenseGeneral((cfg.D,), (cfg.N, self.H))
        self.key = DenseGeneral((cfg.D,), (cfg.N, self.H))
        self.value = DenseGeneral((cfg.D,), (cfg.N, self.H))
        self.attn_out_proj = DenseGeneral((cfg.N, self.H), (cfg.D,))

    def project_qkv(self, x_BxLxD):
        return self.query(x_BxLxD), self.key(x_BxLxD), self.value(x_BxLxD)

    def forward(self, x_BxLxD):
        L = x_BxLxD.shape[1]
        q_BxLxNxH, k_BxLxNxH, v_BxLxNxH = self.project_qkv(x_BxLxD)
        q_BxLxNxH = q_BxLxNxH / math.sqrt(self.H)
        attn_BxNxLxL = torch.einsum("...qhd,...khd->...hqk", q_BxLxNxH, k_BxLxNxH)
        causal_LxL = torch.tril(torch.ones(L, L, dtype=torch.bool, device=x_BxLxD.device))
        _NEG_INF = torch.finfo(attn_BxNxLxL.dtype).min
        attn_BxNxLxL = torch.where(causal_LxL[None, None], attn_BxNxLxL,
                                   torch.tensor(_NEG_INF, dtype=attn_BxNxLxL.dtype))
        attn_BxNxLxL = F.softmax(attn_BxNxLxL, dim=-1)
        out_BxLxNxH = torch.einsum("...hqk,...khd->...qhd", attn_BxNxLxL, v_BxLxNxH)
        return self.attn_out_proj(out_BxLxNxH)


class CausalAttnSharedQK(CausalAttn):
    """Shared query/key projection (one kernel for both), as in Reformer's shared-QK attention."""

    def project_qkv(self, x_BxLxD):
        q = self.query(x_BxLxD)
        return q, self.query(x_BxLxD), self.value(x_BxLxD)


class Mlp(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.fc1 = nn.Linear(cfg.D, cfg.F)
        self.fc2 = nn.Linear(cfg.F, cfg.D)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class TBlock(nn.Module):
    def __init__(self, cfg, attn_cls):
        super().__init__()
        self.ln1 = LayerNorm(cfg.D)
        self.attn = attn_cls(cfg)
        self.ln2 = LayerNorm(cfg.D)
        self.mlp = Mlp(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Embed(nn.Embedding):
    def attend(self, query):
        return query @ self.weight.t()


class TransformerDo(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed = Embed(cfg.V, cfg.D)
        self.pos_embed = nn.Embedding(cfg.L, cfg.D)
        self.blocks = nn.ModuleList(
            [TBlock(cfg, CausalAttnSharedQK if i in cfg.shared_qk_blocks else CausalAttn)
             for i in range(cfg.num_layers)]
        )
        self.out_ln = LayerNorm(cfg.D)

    def forward(self, y_BxL):
        L = y_BxL.shape[1]
        y_BxLxD = self.embed(y_BxL) + self.pos_embed(torch.arange(L, device=y_BxL.device))[None]
        for block in self.blocks:
            y_BxLxD = block(y_BxLxD)
        return self.embed.attend(self.out_ln(y_BxLxD))


def make_model():
    torch.manual_seed(1905)
    cfg = SimpleNamespace(V=96, D=64, N=4, F=192, L=64, num_layers=3, shared_qk_blocks=(1,))
    model = TransformerDo(cfg)
    g = torch.Generator().manual_seed(19051)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LayerNorm):
                m.scale.copy_(1.0 + 0.3 * torch.randn(m.scale.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
        model.embed.weight.mul_(0.5)
        model.pos_embed.weight.mul_(0.5)
    return model.eval()

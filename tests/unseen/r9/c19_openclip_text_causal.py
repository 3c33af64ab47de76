"""open_clip text tower with the custom `Attention` class (open_clip/transformer.py),
plain scaled dot-product path (scaled_cosine=False, scale_heads=False).

in_proj_weight / in_proj_bias parameters chunked into q, k, v; heads folded into the batch;
q * head_dim**-0.5 before bmm; the tower's additive causal mask (-inf above the diagonal,
built once for context_length 77 and sliced) is added to the scores; LayerScale on the
branch. 5 heads of 16, width 80.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(
        self,
        dim,
        num_heads=8,
        qkv_bias=True,
        scaled_cosine=False,
        scale_heads=False,
        logit_scale_max=math.log(1.0 / 0.01),
        attn_drop=0.0,
        proj_drop=0.0,
    ):
        super().__init__()
        self.scaled_cosine = scaled_cosine
        self.scale_heads = scale_heads
        assert dim % num_heads == 0, "dim should be divisible by num_heads"
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.logit_scale_max = logit_scale_max
        self.in_proj_weight = nn.Parameter(torch.randn((dim * 3, dim)) * self.scale)
        if qkv_bias:
            self.in_proj_bias = nn.Parameter(torch.zeros(dim * 3))
        else:
            self.in_proj_bias = None
        if self.scaled_cosine:
            self.logit_scale = nn.Parameter(torch.log(10 * torch.ones((num_heads, 1, 1))))
        else:
            self.logit_scale = None
        self.attn_drop = nn.Dropout(attn_drop)
        self.out_proj = nn.Linear(dim, dim)
        self.out_drop = nn.Dropout(proj_drop)

    def forward(self, x, attn_mask=None):
        N, L, C = x.shape
        q, k, v = F.linear(x, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1)
        q = q.reshape(N, L, self.num_heads, -1).transpose(1, 2).reshape(N * self.num_heads, L, -1)
        k = k.reshape(N, L, self.num_heads, -1).transpose(1, 2).reshape(N * self.num_heads, L, -1)
        v = v.reshape(N, L, self.num_heads, -1).transpose(1, 2).reshape(N * self.num_heads, L, -1)

        if self.logit_scale is not None:
            attn = torch.bmm(F.normalize(q, dim=-1), F.normalize(k, dim=-1).transpose(-1, -2))
            logit_scale = torch.clamp(self.logit_scale, max=self.logit_scale_max).exp()
            attn = attn.view(N, self.num_heads, L, L) * logit_scale
            attn = attn.view(-1, L, L)
        else:
            q = q * self.scale
            attn = torch.bmm(q, k.transpose(-1, -2))
        if attn_mask is not None:
            attn = attn + attn_mask
        attn = attn.softmax(dim=-1)
        attn = self.attn_drop(attn)
        x = torch.bmm(attn, v)
        x = x.view(N, self.num_heads, L, -1).transpose(1, 2).reshape(N, L, C)
        x = self.out_proj(x)
        return self.out_drop(x)


class LayerScale(nn.Module):
    def __init__(self, dim, init_values=1e-5):
        super().__init__()
        self.gamma = nn.Parameter(init_values * torch.ones(dim))

    def forward(self, x):
        return x * self.gamma


class CustomResidualAttentionBlock(nn.Module):
    def __init__(self, d_model=80, n_head=5):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = Attention(d_model, n_head, scaled_cosine=False, scale_heads=False)
        self.ls_1 = LayerScale(d_model, 1.0)

    def forward(self, x, attn_mask=None):
        return x + self.ls_1(self.attn(self.ln_1(x), attn_mask=attn_mask))


class TextTower(nn.Module):
    def __init__(self, context_length=77):
        super().__init__()
        self.context_length = context_length
        self.resblocks = nn.ModuleList([CustomResidualAttentionBlock()])
        self.register_buffer("attn_mask", self.build_causal_mask(), persistent=False)

    def build_causal_mask(self):
        # additive causal mask, -inf above the diagonal
        mask = torch.empty(self.context_length, self.context_length)
        mask.fill_(float("-inf"))
        mask.triu_(1)
        return mask

    def forward(self, x):
        n = x.shape[1]
        attn_mask = self.attn_mask[:n, :n].to(x.dtype)
        for r in self.resblocks:
            x = r(x, attn_mask=attn_mask)
        return x


def make_text_tower():
    torch.manual_seed(119)
    tower = TextTower()
    with torch.no_grad():
        blk = tower.resblocks[0]
        blk.ln_1.weight.uniform_(0.5, 1.5)
        blk.ln_1.bias.uniform_(-0.1, 0.1)
        blk.attn.in_proj_bias.uniform_(-0.1, 0.1)
        blk.ls_1.gamma.uniform_(0.5, 1.5)
    return tower.eval()


EXPECT = {
    "target": "make_text_tower",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "resblocks.0.attn",
    "structure": {
        "heads": 5,
        "kv_heads": 5,
        "head_dim": 16,
        "causal": True,
        "cross": False,
        "rope": None,
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "open_clip text tower with the custom Attention (in_proj_weight chunk(3), heads folded into the batch, "
    "q * scale then bmm, scaled_cosine off) and the tower's sliced additive -inf triu causal mask, LayerScale branch",
}

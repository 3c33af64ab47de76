"""OpenCLIP's causal text tower (open_clip/transformer.py TextTransformer), per-token output.

TextTransformer: token_embedding, positional_embedding (learned Parameter, context_length 64),
transformer (Transformer: resblocks.N), ln_final, text_projection (Parameter), and the `attn_mask`
buffer from build_causal_mask (-inf above the diagonal, sliced [:seq_len, :seq_len]).  It returns
ln_final(x) @ text_projection for every token (b, s, 48); OpenCLIP's pooled feature is the row at the
EOT token of this.  Blocks are pre-LN: ln_1 -> attention -> ls_1 (Identity) -> + x -> ln_2 -> mlp
(c_fc, GELU, c_proj) -> ls_2 -> + x.
The tower mixes block types (`block_types` in the config): resblocks 0 and 1 are ResidualAttentionBlock
around nn.MultiheadAttention(batch_first=True) called with attn_mask; resblock 2 is a
CustomResidualAttentionBlock with OpenCLIP's own `Attention` (in_proj_weight/in_proj_bias chunked into
q, k, v, (N*heads) bmm, q * head_dim**-0.5, `attn += attn_mask`, softmax, out_proj; no scaled cosine,
no head scale) plus ln_attn (scale_attn True).
Slip: CustomResidualAttentionBlock.forward takes attn_mask but calls self.attn(self.ln_1(x)) without
it, so the last block's attention is not causal.
No cache.  Returns the (b, s, 48) text features.
"""

import math
from collections import OrderedDict
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": [
        "transformer.resblocks.0.attn",
        "transformer.resblocks.1.attn",
        "transformer.resblocks.2.attn",
    ],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "transformer.resblocks.2.attn",
    "stage": "masked_scores",
    "mistake": "missing_mask",
    "style": "open_clip TextTransformer: learned positional_embedding, build_causal_mask buffer, resblocks with "
    "nn.MultiheadAttention(batch_first) and one CustomResidualAttentionBlock (open_clip Attention: in_proj_weight, "
    "(N*heads) bmm); the custom block drops attn_mask",
}


class LayerNorm(nn.LayerNorm):
    def forward(self, x):
        orig_type = x.dtype
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.to(orig_type)


class ResidualAttentionBlock(nn.Module):
    def __init__(self, d_model, n_head, mlp_ratio=4.0, batch_first=True):
        super().__init__()
        self.ln_1 = LayerNorm(d_model)
        self.attn = nn.MultiheadAttention(d_model, n_head, batch_first=batch_first)
        self.ls_1 = nn.Identity()
        self.ln_2 = LayerNorm(d_model)
        mlp_width = int(d_model * mlp_ratio)
        self.mlp = nn.Sequential(
            OrderedDict([("c_fc", nn.Linear(d_model, mlp_width)), ("gelu", nn.GELU()), ("c_proj", nn.Linear(mlp_width, d_model))])
        )
        self.ls_2 = nn.Identity()

    def attention(self, q_x, attn_mask=None):
        attn_mask = attn_mask.to(q_x.dtype) if attn_mask is not None else None
        return self.attn(q_x, q_x, q_x, need_weights=False, attn_mask=attn_mask)[0]

    def forward(self, q_x, attn_mask=None):
        x = q_x + self.ls_1(self.attention(q_x=self.ln_1(q_x), attn_mask=attn_mask))
        return x + self.ls_2(self.mlp(self.ln_2(x)))


class Attention(nn.Module):
    def __init__(self, dim, num_heads=8, qkv_bias=True, batch_first=True):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.batch_first = batch_first
        self.in_proj_weight = nn.Parameter(torch.randn((dim * 3, dim)) * self.scale)
        self.in_proj_bias = nn.Parameter(torch.zeros(dim * 3)) if qkv_bias else None
        self.logit_scale = None
        self.head_scale = None
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x, attn_mask=None):
        if self.batch_first:
            x = x.transpose(0, 1)
        L, N, C = x.shape
        q, k, v = F.linear(x, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1)
        q = q.reshape(L, N * self.num_heads, -1).transpose(0, 1)
        k = k.reshape(L, N * self.num_heads, -1).transpose(0, 1)
        v = v.reshape(L, N * self.num_heads, -1).transpose(0, 1)
        q = q * self.scale
        attn = torch.bmm(q, k.transpose(-1, -2))
        if attn_mask is not None:
            attn = attn + attn_mask
        attn = attn.softmax(dim=-1)
        x = torch.bmm(attn, v)
        x = x.transpose(0, 1).reshape(L, N, C)
        if self.batch_first:
            x = x.transpose(0, 1)
        return self.out_proj(x)


class CustomResidualAttentionBlock(nn.Module):
    def __init__(self, d_model, n_head, mlp_ratio=4.0, scale_attn=True, batch_first=True):
        super().__init__()
        self.ln_1 = LayerNorm(d_model)
        self.attn = Attention(d_model, n_head, batch_first=batch_first)
        self.ln_attn = LayerNorm(d_model) if scale_attn else nn.Identity()
        self.ls_1 = nn.Identity()
        self.ln_2 = LayerNorm(d_model)
        mlp_width = int(d_model * mlp_ratio)
        self.mlp = nn.Sequential(
            OrderedDict([("c_fc", nn.Linear(d_model, mlp_width)), ("gelu", nn.GELU()), ("ln", nn.Identity()), ("c_proj", nn.Linear(mlp_width, d_model))])
        )
        self.ls_2 = nn.Identity()

    def forward(self, x, attn_mask=None):
        x = x + self.ls_1(self.ln_attn(self.attn(self.ln_1(x))))
        return x + self.ls_2(self.mlp(self.ln_2(x)))


BLOCKS = {"default": ResidualAttentionBlock, "custom": CustomResidualAttentionBlock}


class Transformer(nn.Module):
    def __init__(self, width, layers, heads, block_types):
        super().__init__()
        self.width = width
        self.layers = layers
        self.resblocks = nn.ModuleList([BLOCKS[block_types[i]](width, heads) for i in range(layers)])

    def forward(self, x, attn_mask=None):
        for r in self.resblocks:
            x = r(x, attn_mask=attn_mask)
        return x


class TextTransformer(nn.Module):
    def __init__(self, context_length, vocab_size, width, heads, layers, output_dim, block_types):
        super().__init__()
        self.num_pos = self.context_length = context_length
        self.token_embedding = nn.Embedding(vocab_size, width)
        self.positional_embedding = nn.Parameter(torch.empty(self.num_pos, width))
        self.transformer = Transformer(width, layers, heads, block_types)
        self.ln_final = LayerNorm(width)
        self.text_projection = nn.Parameter(torch.empty(width, output_dim))
        self.register_buffer("attn_mask", self.build_causal_mask(), persistent=False)
        nn.init.normal_(self.token_embedding.weight, std=0.02 * 10)
        nn.init.normal_(self.positional_embedding, std=0.01 * 10)
        nn.init.normal_(self.text_projection, std=width**-0.5)

    def build_causal_mask(self):
        mask = torch.empty(self.num_pos, self.num_pos)
        mask.fill_(float("-inf"))
        mask.triu_(1)
        return mask

    def forward(self, text):
        seq_len = text.shape[1]
        x = self.token_embedding(text)
        attn_mask = self.attn_mask[:seq_len, :seq_len]
        x = x + self.positional_embedding[:seq_len].to(x.dtype)
        x = self.transformer(x, attn_mask=attn_mask)
        x = self.ln_final(x)
        return x @ self.text_projection


def make_model():
    torch.manual_seed(1608)
    model = TextTransformer(
        context_length=64, vocab_size=96, width=64, heads=4, layers=3, output_dim=48,
        block_types=["default", "default", "custom"],
    )
    g = torch.Generator().manual_seed(16081)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
            if isinstance(m, nn.MultiheadAttention):
                m.in_proj_bias.normal_(0.0, 0.1, generator=g)
            if isinstance(m, Attention):
                m.in_proj_bias.normal_(0.0, 0.1, generator=g)
    return model.eval()

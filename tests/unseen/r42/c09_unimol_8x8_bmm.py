"""Uni-Mol (dptech-corp/Uni-Mol, on Uni-Core's unicore/modules) molecular encoder:
SelfMultiheadAttention with one fused `in_proj` chunked into q, k, v, heads folded into the batch
axis ((bsz * num_heads, tokens, head_dim), fairseq style), q pre-multiplied by head_dim ** -0.5,
torch.bmm scores, the pair representation added as attn_bias, softmax_dropout, bmm context, heads
unfolded and `out_proj`. Pre-LayerNorm TransformerEncoderLayer. Inputs are per-atom features
(batch, atoms, 64); the plain encoder layer below has no pair bias (attn_bias=None).

This file: correct: 8 heads of 8."""

import math

import torch
import torch.nn.functional as F
from torch import nn


def softmax_dropout(input, dropout_prob, is_training=True, mask=None, bias=None):
    """Uni-Core's fused kernel, reference semantics: softmax(input + mask + bias) then dropout."""
    input = input.contiguous()
    if mask is not None:
        input = input + mask
    if bias is not None:
        input = input + bias
    out = F.softmax(input, dim=-1)
    return F.dropout(out, dropout_prob, is_training)


class SelfMultiheadAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, dropout=0.1, bias=True, scaling_factor=1):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.head_dim = embed_dim // num_heads
        assert self.head_dim * num_heads == self.embed_dim
        self.scaling = (self.head_dim * scaling_factor) ** -0.5
        self.in_proj = nn.Linear(embed_dim, embed_dim * 3, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)

    def forward(self, query, key_padding_mask=None, attn_bias=None, return_attn=False):
        bsz, tgt_len, embed_dim = query.size()
        assert embed_dim == self.embed_dim

        q, k, v = self.in_proj(query).chunk(3, dim=-1)
        q = (
            q.view(bsz, tgt_len, self.num_heads, self.head_dim)
            .transpose(1, 2)
            .contiguous()
            .view(bsz * self.num_heads, -1, self.head_dim)
            * self.scaling
        )
        if k is not None:
            k = (
                k.view(bsz, -1, self.num_heads, self.head_dim)
                .transpose(1, 2)
                .contiguous()
                .view(bsz * self.num_heads, -1, self.head_dim)
            )
        if v is not None:
            v = (
                v.view(bsz, -1, self.num_heads, self.head_dim)
                .transpose(1, 2)
                .contiguous()
                .view(bsz * self.num_heads, -1, self.head_dim)
            )
        assert k is not None
        src_len = k.size(1)

        attn_weights = torch.bmm(q, k.transpose(1, 2))
        assert list(attn_weights.size()) == [bsz * self.num_heads, tgt_len, src_len]

        if key_padding_mask is not None:
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len)
            attn_weights.masked_fill_(
                key_padding_mask.unsqueeze(1).unsqueeze(2).to(torch.bool), float("-inf")
            )
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)

        attn = softmax_dropout(attn_weights, self.dropout, self.training, bias=attn_bias)
        o = torch.bmm(attn, v)
        assert list(o.size()) == [bsz * self.num_heads, tgt_len, self.head_dim]
        o = (
            o.view(bsz, self.num_heads, tgt_len, self.head_dim)
            .transpose(1, 2)
            .contiguous()
            .view(bsz, tgt_len, embed_dim)
        )
        o = self.out_proj(o)
        if not return_attn:
            return o
        return o, attn_weights, attn


class TransformerEncoderLayer(nn.Module):
    def __init__(
        self,
        embed_dim=64,
        ffn_embed_dim=128,
        attention_heads=4,
        dropout=0.1,
        attention_dropout=0.1,
        activation_dropout=0.0,
        post_ln=False,
    ):
        super().__init__()
        self.embed_dim = embed_dim
        self.dropout = dropout
        self.self_attn = SelfMultiheadAttention(
            embed_dim, attention_heads, dropout=attention_dropout
        )
        self.self_attn_layer_norm = nn.LayerNorm(embed_dim)
        self.fc1 = nn.Linear(embed_dim, ffn_embed_dim)
        self.fc2 = nn.Linear(ffn_embed_dim, embed_dim)
        self.final_layer_norm = nn.LayerNorm(embed_dim)
        self.post_ln = post_ln

    def forward(self, x, attn_bias=None, padding_mask=None):
        residual = x
        x = self.self_attn_layer_norm(x)
        x = self.self_attn(query=x, key_padding_mask=padding_mask, attn_bias=attn_bias)
        x = F.dropout(x, p=self.dropout, training=self.training)
        x = residual + x
        residual = x
        x = self.final_layer_norm(x)
        x = self.fc2(F.gelu(self.fc1(x)))
        return residual + x


class TransformerEncoderWithPair(nn.Module):
    """The atom stream of Uni-Mol's encoder, one layer."""

    def __init__(self, embed_dim=64, attention_heads=8):
        super().__init__()
        self.attention_heads = attention_heads
        self.emb_layer_norm = nn.LayerNorm(embed_dim)
        self.layers = nn.ModuleList(
            [TransformerEncoderLayer(embed_dim=embed_dim, attention_heads=attention_heads)]
        )

    def forward(self, emb):
        x = self.emb_layer_norm(emb)
        attn_bias = None

        for layer in self.layers:
            x = layer(x, attn_bias=attn_bias)
        return x


def make_unimol_encoder():
    torch.manual_seed(4209)
    model = TransformerEncoderWithPair()
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.Linear):
                mod.weight.normal_(0.0, 0.2)
                if mod.bias is not None:
                    mod.bias.uniform_(-0.2, 0.2)
            elif isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {
    "target": "make_unimol_encoder",
    "kind": "multihead",
    "ok": True,
    "layer": "layers.0.self_attn",
    "structure": {
        "heads": 8,
        "kv_heads": 8,
        "head_dim": 8,
        "causal": False,
        "cross": False,
        "rope": None,
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "Uni-Mol (c09_unimol_8x8_bmm): correct: 8 heads of 8",
}

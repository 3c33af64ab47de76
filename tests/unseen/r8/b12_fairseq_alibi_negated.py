"""ALiBi decoder layer in the style of the original fairseq ALiBi code (time-first
MultiheadAttention, key-position form slopes * arange(maxpos) added to the future
mask), 4 heads, with the bias negated ("a penalty must be negative"): -slope * j
rewards keys far in the past instead of penalising them.
"""

import math

import torch
from torch import nn


def get_slopes(n):
    def get_slopes_power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        ratio = start
        return [start * ratio**i for i in range(n)]

    if math.log2(n).is_integer():
        return get_slopes_power_of_2(n)
    closest_power_of_2 = 2 ** math.floor(math.log2(n))
    return (
        get_slopes_power_of_2(closest_power_of_2)
        + get_slopes(2 * closest_power_of_2)[0::2][: n - closest_power_of_2]
    )


class MultiheadAttention(nn.Module):
    def __init__(self, embed_dim=64, num_heads=8):
        super().__init__()
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim**-0.5
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=True)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=True)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=True)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=True)

    def forward(self, query, key, value, attn_mask=None):
        tgt_len, bsz, embed_dim = query.size()
        q = self.q_proj(query) * self.scaling
        k = self.k_proj(key)
        v = self.v_proj(value)
        q = q.contiguous().view(tgt_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        k = k.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        v = v.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        attn_weights = torch.bmm(q, k.transpose(1, 2))
        if attn_mask is not None:
            attn_weights = attn_weights + attn_mask
        attn_probs = torch.softmax(attn_weights, dim=-1)
        attn = torch.bmm(attn_probs, v)
        attn = attn.transpose(0, 1).contiguous().view(tgt_len, bsz, embed_dim)
        return self.out_proj(attn), None


class AlibiTransformerDecoderLayer(nn.Module):
    def __init__(self, embed_dim=64, heads=4, max_positions=128):
        super().__init__()
        self.self_attn = MultiheadAttention(embed_dim, heads)
        self.self_attn_layer_norm = nn.LayerNorm(embed_dim)
        self.heads = heads
        slopes = torch.Tensor(get_slopes(heads))
        alibi = -slopes.unsqueeze(1).unsqueeze(1) * torch.arange(max_positions).unsqueeze(
            0
        ).unsqueeze(0).expand(heads, -1, -1)
        self.register_buffer("alibi", alibi.view(heads, 1, max_positions), persistent=False)
        self.max_positions = max_positions

    def buffered_future_mask(self, tensor, bsz):
        dim = tensor.size(0)
        future = torch.triu(
            torch.full((self.max_positions, self.max_positions), float("-inf"), dtype=tensor.dtype),
            1,
        )
        future = future.unsqueeze(0) + self.alibi.to(tensor.dtype)
        future = future.repeat(bsz, 1, 1)
        return future[:, :dim, :dim]

    def forward(self, x_btc):
        x = x_btc.transpose(0, 1)  # fairseq works time-first
        residual = x
        x = self.self_attn_layer_norm(x)
        mask = self.buffered_future_mask(x, x.size(1))
        x, _ = self.self_attn(query=x, key=x, value=x, attn_mask=mask)
        return (residual + x).transpose(0, 1)


def make_alibi_decoder_layer():
    torch.manual_seed(20)
    layer = AlibiTransformerDecoderLayer()
    with torch.no_grad():
        layer.self_attn_layer_norm.weight.uniform_(0.5, 1.5)
    return layer


EXPECT = {
    "target": "make_alibi_decoder_layer",
    "kind": "causal-multihead",
    "ok": False,
    "layer": "self_attn",
    "stage": "biased_scores",
    "mistake": "bias_sign",
    "style": "ofirpress ALiBi / fairseq decoder (4 heads, time-first): the key-position bias is negated, "
    "-slope*j = +slope*(i-j) + const, which favours distant tokens",
}

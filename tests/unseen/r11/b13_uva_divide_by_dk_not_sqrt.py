"""UvA tutorial MHA: scaled_dot_product divides by d_k instead of sqrt(d_k) (1/16 instead of 1/4)

Base: UvA Deep Learning course (tutorial 6) style MultiheadAttention: one qkv_proj whose output is
reshaped to (B, S, H, 3 * head_dim), permuted to (B, H, S, 3 * head_dim) and chunked into q, k, v
(so each head's q/k/v columns sit side by side), scaled_dot_product with masked_fill(-9e15),
values permuted back and o_proj. Used inside the tutorial's post-norm EncoderBlock.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn


def scaled_dot_product(q, k, v, mask=None):
    d_k = q.size()[-1]
    attn_logits = torch.matmul(q, k.transpose(-2, -1))
    attn_logits = attn_logits / d_k
    if mask is not None:
        attn_logits = attn_logits.masked_fill(mask == 0, -9e15)
    attention = F.softmax(attn_logits, dim=-1)
    values = torch.matmul(attention, v)
    return values, attention


class MultiheadAttention(nn.Module):
    def __init__(self, input_dim, embed_dim, num_heads):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.qkv_proj = nn.Linear(input_dim, 3 * embed_dim)
        self.o_proj = nn.Linear(embed_dim, input_dim)
        self._reset_parameters()

    def _reset_parameters(self):
        nn.init.xavier_uniform_(self.qkv_proj.weight)
        self.qkv_proj.bias.data.uniform_(-0.1, 0.1)
        nn.init.xavier_uniform_(self.o_proj.weight)
        self.o_proj.bias.data.uniform_(-0.1, 0.1)

    def forward(self, x, mask=None, return_attention=False):
        batch_size, seq_length, _ = x.size()
        qkv = self.qkv_proj(x)
        qkv = qkv.reshape(batch_size, seq_length, self.num_heads, 3 * self.head_dim)
        qkv = qkv.permute(0, 2, 1, 3)
        q, k, v = qkv.chunk(3, dim=-1)
        values, attention = scaled_dot_product(q, k, v, mask=mask)
        values = values.permute(0, 2, 1, 3)
        values = values.reshape(batch_size, seq_length, self.embed_dim)
        o = self.o_proj(values)
        if return_attention:
            return o, attention
        return o


class EncoderBlock(nn.Module):
    def __init__(self, input_dim=64, num_heads=4, dim_feedforward=128, dropout=0.0):
        super().__init__()
        self.self_attn = MultiheadAttention(input_dim, input_dim, num_heads)
        self.norm1 = nn.LayerNorm(input_dim)

    def forward(self, x, mask=None):
        attn_out = self.self_attn(x, mask=mask)
        return self.norm1(x + attn_out)


def make_uva_encoder_block():
    torch.manual_seed(1105)
    block = EncoderBlock()
    with torch.no_grad():
        block.norm1.weight.uniform_(0.5, 1.5)
        block.norm1.bias.uniform_(-0.2, 0.2)
    return block.eval()


EXPECT = {
    "target": "make_uva_encoder_block",
    "kind": "multihead",
    "ok": False,
    "layer": "self_attn",
    "stage": "scaled_scores",
    "mistake": "wrong_scale",
    "style": "UvA tutorial MHA: scaled_dot_product divides by d_k instead of sqrt(d_k) (1/16 instead "
    "of 1/4)",
}

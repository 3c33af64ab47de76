"""UvA deep-learning-tutorial style MultiheadAttention (qkv_proj per-head [q,k,v], o_proj) in an EncoderBlock; bug: the causal mask is multiplied into the logits (hidden scores become 0)."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def scaled_dot_product(q, k, v, mask=None):
    d_k = q.size()[-1]
    attn_logits = torch.matmul(q, k.transpose(-2, -1))
    attn_logits = attn_logits / math.sqrt(d_k)
    if mask is not None:
        attn_logits = attn_logits * mask
    attention = F.softmax(attn_logits, dim=-1)
    values = torch.matmul(attention, v)
    return values, attention


class MultiheadAttention(nn.Module):
    def __init__(self, input_dim, embed_dim, num_heads):
        super().__init__()
        assert embed_dim % num_heads == 0, "Embedding dimension must be 0 modulo number of heads."
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        # stack all weight matrices 1...h together for efficiency
        self.qkv_proj = nn.Linear(input_dim, 3 * embed_dim)
        self.o_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, x, mask=None, return_attention=False):
        batch_size, seq_length, _ = x.size()
        qkv = self.qkv_proj(x)
        qkv = qkv.reshape(batch_size, seq_length, self.num_heads, 3 * self.head_dim)
        qkv = qkv.permute(0, 2, 1, 3)  # [batch, head, seq_len, 3 * head_dim]
        q, k, v = qkv.chunk(3, dim=-1)

        values, attention = scaled_dot_product(q, k, v, mask=mask)
        values = values.permute(0, 2, 1, 3).reshape(batch_size, seq_length, self.embed_dim)
        o = self.o_proj(values)
        return (o, attention) if return_attention else o


class EncoderBlock(nn.Module):
    def __init__(self, input_dim, num_heads, dim_feedforward, dropout=0.0, causal=True):
        super().__init__()
        self.causal = causal
        self.self_attn = MultiheadAttention(input_dim, input_dim, num_heads)
        self.linear_net = nn.Sequential(
            nn.Linear(input_dim, dim_feedforward),
            nn.Dropout(dropout),
            nn.ReLU(inplace=True),
            nn.Linear(dim_feedforward, input_dim),
        )
        self.norm1 = nn.LayerNorm(input_dim)
        self.norm2 = nn.LayerNorm(input_dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, mask=None):
        if mask is None and self.causal:
            seq_length = x.size(1)
            mask = torch.tril(torch.ones(seq_length, seq_length, device=x.device))
        attn_out = self.self_attn(x, mask=mask)
        x = self.norm1(x + self.dropout(attn_out))
        return self.norm2(x + self.dropout(self.linear_net(x)))


def make_block():
    return EncoderBlock(input_dim=24, num_heads=4, dim_feedforward=48, dropout=0.0, causal=True)


EXPECT = {
    "target": "make_block",
    "kind": "causal-multihead",
    "ok": False,
    "stage": "masked_scores",
    "mistake": "mask_fill_value",
    "layer": "self_attn",
    "style": "UvA DL tutorial 6 MultiheadAttention (qkv_proj reshaped per head [q, k, v], o_proj), mask multiplied into logits",
}

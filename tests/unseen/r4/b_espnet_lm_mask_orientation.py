"""ESPnet-style Transformer LM layer stack; bug: subsequent_mask is built with triu instead of tril, so every token sees itself and the future instead of the past."""

import math

import torch
from torch import nn


def subsequent_mask(size, device="cpu", dtype=torch.bool):
    """Mask of allowed (query, key) pairs for causal self-attention."""
    ret = torch.ones(size, size, device=device, dtype=dtype)
    return torch.triu(ret, out=ret)


class MultiHeadedAttention(nn.Module):
    def __init__(self, n_head, n_feat, dropout_rate):
        super().__init__()
        assert n_feat % n_head == 0
        self.d_k = n_feat // n_head
        self.h = n_head
        self.linear_q = nn.Linear(n_feat, n_feat)
        self.linear_k = nn.Linear(n_feat, n_feat)
        self.linear_v = nn.Linear(n_feat, n_feat)
        self.linear_out = nn.Linear(n_feat, n_feat)
        self.attn = None
        self.dropout = nn.Dropout(p=dropout_rate)

    def forward_qkv(self, query, key, value):
        n_batch = query.size(0)
        q = self.linear_q(query).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        k = self.linear_k(key).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        v = self.linear_v(value).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        return q, k, v

    def forward_attention(self, value, scores, mask):
        n_batch = value.size(0)
        if mask is not None:
            mask = mask.unsqueeze(1).eq(0)
            min_value = torch.finfo(scores.dtype).min
            scores = scores.masked_fill(mask, min_value)
            self.attn = torch.softmax(scores, dim=-1).masked_fill(mask, 0.0)
        else:
            self.attn = torch.softmax(scores, dim=-1)
        x = torch.matmul(self.dropout(self.attn), value)
        x = x.transpose(1, 2).contiguous().view(n_batch, -1, self.h * self.d_k)
        return self.linear_out(x)

    def forward(self, query, key, value, mask=None):
        q, k, v = self.forward_qkv(query, key, value)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.d_k)
        return self.forward_attention(v, scores, mask)


class PositionwiseFeedForward(nn.Module):
    def __init__(self, idim, hidden_units, dropout_rate):
        super().__init__()
        self.w_1 = nn.Linear(idim, hidden_units)
        self.w_2 = nn.Linear(hidden_units, idim)
        self.dropout = nn.Dropout(dropout_rate)

    def forward(self, x):
        return self.w_2(self.dropout(torch.relu(self.w_1(x))))


class EncoderLayer(nn.Module):
    def __init__(self, size, self_attn, feed_forward, dropout_rate, normalize_before=True):
        super().__init__()
        self.self_attn = self_attn
        self.feed_forward = feed_forward
        self.norm1 = nn.LayerNorm(size, eps=1e-12)
        self.norm2 = nn.LayerNorm(size, eps=1e-12)
        self.dropout = nn.Dropout(dropout_rate)
        self.size = size
        self.normalize_before = normalize_before

    def forward(self, x, mask):
        residual = x
        if self.normalize_before:
            x = self.norm1(x)
        x = residual + self.dropout(self.self_attn(x, x, x, mask))
        if not self.normalize_before:
            x = self.norm1(x)
        residual = x
        if self.normalize_before:
            x = self.norm2(x)
        x = residual + self.dropout(self.feed_forward(x))
        if not self.normalize_before:
            x = self.norm2(x)
        return x, mask


class TransformerLM(nn.Module):
    """Decoder-only LM body: embedded input in, hidden states out."""

    def __init__(
        self, attention_dim=24, attention_heads=4, linear_units=48, num_blocks=1, dropout_rate=0.0
    ):
        super().__init__()
        self.encoders = nn.ModuleList(
            [
                EncoderLayer(
                    attention_dim,
                    MultiHeadedAttention(attention_heads, attention_dim, dropout_rate),
                    PositionwiseFeedForward(attention_dim, linear_units, dropout_rate),
                    dropout_rate,
                )
                for _ in range(num_blocks)
            ]
        )
        self.after_norm = nn.LayerNorm(attention_dim, eps=1e-12)

    def forward(self, xs, mask=None):
        if mask is None:
            mask = subsequent_mask(xs.size(1), device=xs.device).unsqueeze(0)
        for layer in self.encoders:
            xs, mask = layer(xs, mask)
        return self.after_norm(xs)


def make_lm():
    return TransformerLM()


EXPECT = {
    "target": "make_lm",
    "kind": "causal-multihead",
    "ok": False,
    "stage": "masked_scores",
    "mistake": "mask_diagonal",
    "layer": "encoders.0.self_attn",
    "style": "ESPnet TransformerLM with MultiHeadedAttention (subsequent_mask)",
}

"""BERT4Rec (jaywonchung BERT4Rec-VAE-Pytorch) TransformerBlock: the Annotated-Transformer-lineage
MultiHeadedAttention with linear_layers (a ModuleList of three d_model x d_model Linears zipped with
(query, key, value)), view(B, -1, h, d_k).transpose(1, 2), a separate Attention module (matmul /
sqrt(d_k), masked_fill(mask == 0, -1e9) with the model's (B, 1, T, T) padding mask, softmax),
output_linear; pre-LN SublayerConnection with the repo's unbiased-std LayerNorm; the body adds learned
positions. The block calls self.attention.forward(_x, _x, _x, mask=mask).

This file: bug. out = self.output_linear(x) is computed but x is returned."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class Attention(nn.Module):
    "Compute 'Scaled Dot Product Attention'"

    def forward(self, query, key, value, mask=None, dropout=None):
        scores = torch.matmul(query, key.transpose(-2, -1)) / math.sqrt(query.size(-1))
        if mask is not None:
            scores = scores.masked_fill(mask == 0, -1e9)
        p_attn = F.softmax(scores, dim=-1)
        if dropout is not None:
            p_attn = dropout(p_attn)
        return torch.matmul(p_attn, value), p_attn


class MultiHeadedAttention(nn.Module):
    def __init__(self, h, d_model, dropout=0.1):
        super().__init__()
        assert d_model % h == 0
        self.d_k = d_model // h
        self.h = h
        self.linear_layers = nn.ModuleList([nn.Linear(d_model, d_model) for _ in range(3)])
        self.output_linear = nn.Linear(d_model, d_model)
        self.attention = Attention()
        self.dropout = nn.Dropout(p=dropout)

    def forward(self, query, key, value, mask=None):
        batch_size = query.size(0)
        query, key, value = [
            l(x).view(batch_size, -1, self.h, self.d_k).transpose(1, 2)
            for l, x in zip(self.linear_layers, (query, key, value))
        ]
        x, attn = self.attention(query, key, value, mask=mask, dropout=self.dropout)
        x = x.transpose(1, 2).contiguous().view(batch_size, -1, self.h * self.d_k)
        out = self.output_linear(x)
        return x


class LayerNorm(nn.Module):
    def __init__(self, features, eps=1e-6):
        super().__init__()
        self.a_2 = nn.Parameter(torch.ones(features))
        self.b_2 = nn.Parameter(torch.zeros(features))
        self.eps = eps

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        std = x.std(-1, keepdim=True)
        return self.a_2 * (x - mean) / (std + self.eps) + self.b_2


class SublayerConnection(nn.Module):
    def __init__(self, size, dropout):
        super().__init__()
        self.norm = LayerNorm(size)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, sublayer):
        return x + self.dropout(sublayer(self.norm(x)))


class GELU(nn.Module):
    def forward(self, x):
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * torch.pow(x, 3))))


class PositionwiseFeedForward(nn.Module):
    def __init__(self, d_model, d_ff, dropout=0.1):
        super().__init__()
        self.w_1 = nn.Linear(d_model, d_ff)
        self.w_2 = nn.Linear(d_ff, d_model)
        self.dropout = nn.Dropout(dropout)
        self.activation = GELU()

    def forward(self, x):
        return self.w_2(self.dropout(self.activation(self.w_1(x))))


class TransformerBlock(nn.Module):
    def __init__(self, hidden, attn_heads, feed_forward_hidden, dropout):
        super().__init__()
        self.attention = MultiHeadedAttention(h=attn_heads, d_model=hidden, dropout=dropout)
        self.feed_forward = PositionwiseFeedForward(
            d_model=hidden, d_ff=feed_forward_hidden, dropout=dropout
        )
        self.input_sublayer = SublayerConnection(size=hidden, dropout=dropout)
        self.output_sublayer = SublayerConnection(size=hidden, dropout=dropout)
        self.dropout = nn.Dropout(p=dropout)

    def forward(self, x, mask):
        x = self.input_sublayer(x, lambda _x: self.attention.forward(_x, _x, _x, mask=mask))
        x = self.output_sublayer(x, self.feed_forward)
        return self.dropout(x)


class BERT(nn.Module):
    """BERT4Rec body on already-embedded items: adds the learned position embedding, builds the
    (B, 1, T, T) padding mask and runs the blocks."""

    def __init__(self, max_len=128, hidden=64, n_layers=1, heads=4, dropout=0.1):
        super().__init__()
        self.position = nn.Embedding(max_len, hidden)
        self.transformer_blocks = nn.ModuleList(
            [TransformerBlock(hidden, heads, hidden * 4, dropout) for _ in range(n_layers)]
        )

    def forward(self, x):
        valid = x.new_ones(x.shape[:2])
        mask = (valid > 0).unsqueeze(1).repeat(1, x.size(1), 1).unsqueeze(1)
        x = x + self.position.weight[: x.size(1)].unsqueeze(0).to(x.dtype)
        for transformer in self.transformer_blocks:
            x = transformer.forward(x, mask)
        return x


def make_bert4rec():
    torch.manual_seed(1309)
    model = BERT()
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, LayerNorm):
                mod.a_2.uniform_(0.5, 1.5)
                mod.b_2.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {
    "target": "make_bert4rec",
    "kind": "multihead",
    "ok": False,
    "layer": "transformer_blocks.0.attention",
    "stage": "output",
    "mistake": "missing_out_proj",
    "style": "BERT4Rec MultiHeadedAttention: out = self.output_linear(x) computed, x returned",
}

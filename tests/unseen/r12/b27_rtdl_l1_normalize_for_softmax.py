"""Yandex rtdl (FT-Transformer, "Revisiting Deep Learning Models for Tabular Data") style
MultiheadAttention inside a prenormalised FT-Transformer block: W_q, W_k, W_v, W_out Linears
(W_out only because n_heads > 1), _reshape folding (batch, n_tokens, d) to (batch * n_heads,
n_tokens, d_head), attention_logits = q @ k.transpose(1, 2), softmax(logits / sqrt(d_head_key)),
@ reshaped values, the fold undone with reshape/transpose/reshape, W_out. The block is the rtdl
ModuleDict layout (attention, attention_normalization, ffn, ffn_normalization); the tokens are the
feature tokens of a table row. d_token 96, 8 heads of 12. Bidirectional.

This file's one bug: rtdl MultiheadAttention: F.normalize(p=1) in place of F.softmax, logits divided
by their absolute row sums."""

import math

import torch
import torch.nn.functional as F
from torch import nn


class MultiheadAttention(nn.Module):
    def __init__(self, *, d_token, n_heads, dropout, bias, initialization):
        super().__init__()
        if n_heads > 1:
            assert d_token % n_heads == 0
        self.W_q = nn.Linear(d_token, d_token, bias)
        self.W_k = nn.Linear(d_token, d_token, bias)
        self.W_v = nn.Linear(d_token, d_token, bias)
        self.W_out = nn.Linear(d_token, d_token, bias) if n_heads > 1 else None
        self.n_heads = n_heads
        self.dropout = nn.Dropout(dropout) if dropout else None
        for m in [self.W_q, self.W_k, self.W_v]:
            if initialization == "xavier" and (m is not self.W_v or self.W_out is not None):
                nn.init.xavier_uniform_(m.weight, gain=1 / math.sqrt(2))
            if m.bias is not None:
                nn.init.uniform_(m.bias, -0.1, 0.1)

    def _reshape(self, x):
        batch_size, n_tokens, d = x.shape
        d_head = d // self.n_heads
        return (
            x.reshape(batch_size, n_tokens, self.n_heads, d_head)
            .transpose(1, 2)
            .reshape(batch_size * self.n_heads, n_tokens, d_head)
        )

    def forward(self, x_q, x_kv, key_compression=None, value_compression=None):
        q, k, v = self.W_q(x_q), self.W_k(x_kv), self.W_v(x_kv)
        for tensor in [q, k, v]:
            assert tensor.shape[-1] % self.n_heads == 0
        batch_size = len(q)
        d_head_key = k.shape[-1] // self.n_heads
        d_head_value = v.shape[-1] // self.n_heads
        n_q_tokens = q.shape[1]

        q = self._reshape(q)
        k = self._reshape(k)
        attention_logits = q @ k.transpose(1, 2)
        attention_probs = F.normalize(attention_logits / math.sqrt(d_head_key), p=1, dim=-1)
        if self.dropout is not None:
            attention_probs = self.dropout(attention_probs)
        x = attention_probs @ self._reshape(v)
        x = (
            x.reshape(batch_size, self.n_heads, n_q_tokens, d_head_value)
            .transpose(1, 2)
            .reshape(batch_size, n_q_tokens, self.n_heads * d_head_value)
        )
        if self.W_out is not None:
            x = self.W_out(x)
        return x, {"attention_logits": attention_logits, "attention_probs": attention_probs}


class FTTransformer(nn.Module):
    def __init__(self, d_token=96, n_blocks=1, n_heads=8, ffn_d_hidden=128):
        super().__init__()
        self.blocks = nn.ModuleList([])
        for layer_idx in range(n_blocks):
            layer = nn.ModuleDict(
                {
                    "attention": MultiheadAttention(
                        d_token=d_token,
                        n_heads=n_heads,
                        dropout=0.0,
                        bias=True,
                        initialization="kaiming",
                    ),
                    "ffn": nn.Sequential(
                        nn.Linear(d_token, ffn_d_hidden),
                        nn.ReLU(),
                        nn.Linear(ffn_d_hidden, d_token),
                    ),
                    "attention_residual_dropout": nn.Identity(),
                    "ffn_residual_dropout": nn.Identity(),
                    "output": nn.Identity(),
                }
            )
            layer["attention_normalization"] = nn.LayerNorm(d_token)
            layer["ffn_normalization"] = nn.LayerNorm(d_token)
            self.blocks.append(layer)

    def _start_residual(self, layer, stage, x):
        return layer[f"{stage}_normalization"](x)

    def _end_residual(self, layer, stage, x, x_residual):
        x_residual = layer[f"{stage}_residual_dropout"](x_residual)
        return x + x_residual

    def forward(self, x):
        for layer in self.blocks:
            x_residual = self._start_residual(layer, "attention", x)
            x_residual, _ = layer["attention"](x_residual, x_residual)
            x = self._end_residual(layer, "attention", x, x_residual)
            x_residual = self._start_residual(layer, "ffn", x)
            x_residual = layer["ffn"](x_residual)
            x = self._end_residual(layer, "ffn", x, x_residual)
            x = layer["output"](x)
        return x


def make_ft_transformer():
    torch.manual_seed(1209)
    model = FTTransformer()
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {
    "target": "make_ft_transformer",
    "kind": "multihead",
    "ok": False,
    "layer": "blocks.0.attention",
    "stage": "weights",
    "mistake": "not_softmax",
    "style": "rtdl MultiheadAttention: F.normalize(p=1) in place of F.softmax, logits divided by their "
    "absolute row sums",
}

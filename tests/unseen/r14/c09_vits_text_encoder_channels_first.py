"""VITS / Glow-TTS attentions.MultiHeadAttention, channels-first (b, c, t): 1x1 Conv1d projections
conv_q/conv_k/conv_v/conv_o, view(b, heads, k_channels, t).transpose(2, 3), query / sqrt(k_channels)
times key^T, masked_fill(mask == 0, -1e4), softmax, transpose(2, 3).view(b, d, t) back.

This file: correct (encoder self-attention, window_size None)."""

import math

import torch
import torch.nn.functional as F
from torch import nn


def subsequent_mask(length):
    mask = torch.tril(torch.ones(length, length)).unsqueeze(0).unsqueeze(0)
    return mask


class LayerNorm(nn.Module):
    """Channels-first LayerNorm over (b, channels, t)."""

    def __init__(self, channels, eps=1e-5):
        super().__init__()
        self.channels = channels
        self.eps = eps
        self.gamma = nn.Parameter(torch.ones(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x):
        x = x.transpose(1, -1)
        x = F.layer_norm(x, (self.channels,), self.gamma, self.beta, self.eps)
        return x.transpose(1, -1)


class MultiHeadAttention(nn.Module):
    def __init__(
        self,
        channels,
        out_channels,
        n_heads,
        p_dropout=0.0,
        window_size=None,
        heads_share=True,
        block_length=None,
        proximal_bias=False,
        proximal_init=False,
    ):
        super().__init__()
        assert channels % n_heads == 0
        assert window_size is None, "relative attention is not part of this port"
        self.channels = channels
        self.out_channels = out_channels
        self.n_heads = n_heads
        self.p_dropout = p_dropout
        self.window_size = window_size
        self.block_length = block_length
        self.proximal_bias = proximal_bias
        self.attn = None

        self.k_channels = channels // n_heads
        self.conv_q = nn.Conv1d(channels, channels, 1)
        self.conv_k = nn.Conv1d(channels, channels, 1)
        self.conv_v = nn.Conv1d(channels, channels, 1)
        self.conv_o = nn.Conv1d(channels, out_channels, 1)
        self.drop = nn.Dropout(p_dropout)

        nn.init.xavier_uniform_(self.conv_q.weight)
        nn.init.xavier_uniform_(self.conv_k.weight)
        if proximal_init:
            with torch.no_grad():
                self.conv_k.weight.copy_(self.conv_q.weight)
                self.conv_k.bias.copy_(self.conv_q.bias)
        nn.init.xavier_uniform_(self.conv_v.weight)

    def forward(self, x, c, attn_mask=None):
        q = self.conv_q(x)
        k = self.conv_k(c)
        v = self.conv_v(c)
        x, self.attn = self.attention(q, k, v, mask=attn_mask)
        x = self.conv_o(x)
        return x

    def attention(self, query, key, value, mask=None):
        # reshape [b, d, t] -> [b, n_h, t, d_k]
        b, d, t_s, t_t = (*key.size(), query.size(2))
        query = query.view(b, self.n_heads, self.k_channels, t_t).transpose(2, 3)
        key = key.view(b, self.n_heads, self.k_channels, t_s).transpose(2, 3)
        value = value.view(b, self.n_heads, self.k_channels, t_s).transpose(2, 3)

        scores = torch.matmul(query / math.sqrt(self.k_channels), key.transpose(-2, -1))
        if mask is not None:
            scores = scores.masked_fill(mask == 0, -1e4)
            if self.block_length is not None:
                assert t_s == t_t, "Local attention is only available for self-attention."
                block_mask = (
                    torch.ones_like(scores).triu(-self.block_length).tril(self.block_length)
                )
                scores = scores.masked_fill(block_mask == 0, -1e4)
        p_attn = F.softmax(scores, dim=-1)  # [b, n_h, t_t, t_s]
        p_attn = self.drop(p_attn)
        output = torch.matmul(p_attn, value)
        output = (
            output.transpose(2, 3).contiguous().view(b, d, t_t)
        )  # [b, n_h, t_t, d_k] -> [b, d, t_t]
        return output, p_attn


class FFN(nn.Module):
    def __init__(
        self, in_channels, out_channels, filter_channels, kernel_size, p_dropout=0.0, causal=False
    ):
        super().__init__()
        self.kernel_size = kernel_size
        self.causal = causal
        self.conv_1 = nn.Conv1d(in_channels, filter_channels, kernel_size)
        self.conv_2 = nn.Conv1d(filter_channels, out_channels, kernel_size)
        self.drop = nn.Dropout(p_dropout)

    def _pad(self, x):
        if self.kernel_size == 1:
            return x
        if self.causal:
            return F.pad(x, (self.kernel_size - 1, 0))
        return F.pad(x, ((self.kernel_size - 1) // 2, self.kernel_size // 2))

    def forward(self, x, x_mask):
        x = self.conv_1(self._pad(x * x_mask))
        x = torch.relu(x)
        x = self.drop(x)
        x = self.conv_2(self._pad(x * x_mask))
        return x * x_mask


class Encoder(nn.Module):
    def __init__(
        self,
        hidden_channels,
        filter_channels,
        n_heads,
        n_layers,
        kernel_size=1,
        p_dropout=0.0,
        window_size=None,
    ):
        super().__init__()
        self.n_layers = n_layers
        self.drop = nn.Dropout(p_dropout)
        self.attn_layers = nn.ModuleList()
        self.norm_layers_1 = nn.ModuleList()
        self.ffn_layers = nn.ModuleList()
        self.norm_layers_2 = nn.ModuleList()
        for _ in range(n_layers):
            self.attn_layers.append(
                MultiHeadAttention(
                    hidden_channels,
                    hidden_channels,
                    n_heads,
                    p_dropout=p_dropout,
                    window_size=window_size,
                )
            )
            self.norm_layers_1.append(LayerNorm(hidden_channels))
            self.ffn_layers.append(
                FFN(
                    hidden_channels,
                    hidden_channels,
                    filter_channels,
                    kernel_size,
                    p_dropout=p_dropout,
                )
            )
            self.norm_layers_2.append(LayerNorm(hidden_channels))

    def forward(self, x, x_mask):
        attn_mask = x_mask.unsqueeze(2) * x_mask.unsqueeze(-1)
        x = x * x_mask
        for i in range(self.n_layers):
            y = self.attn_layers[i](x, x, attn_mask)
            y = self.drop(y)
            x = self.norm_layers_1[i](x + y)
            y = self.ffn_layers[i](x, x_mask)
            y = self.drop(y)
            x = self.norm_layers_2[i](x + y)
        return x * x_mask


class TextEncoderLite(nn.Module):
    """VITS TextEncoder minus the embedding table and the stats projection: (b, t, c) in and out."""

    def __init__(
        self, hidden_channels=64, filter_channels=128, n_heads=4, n_layers=1, kernel_size=3
    ):
        super().__init__()
        self.hidden_channels = hidden_channels
        self.encoder = Encoder(hidden_channels, filter_channels, n_heads, n_layers, kernel_size)

    def forward(self, x):
        x = x * math.sqrt(self.hidden_channels)
        x = torch.transpose(x, 1, -1)  # [b, h, t]
        x_mask = torch.ones(x.size(0), 1, x.size(2), dtype=x.dtype, device=x.device)
        x = self.encoder(x * x_mask, x_mask)
        return torch.transpose(x, 1, -1)


def make_vits_text_encoder():
    torch.manual_seed(1471)
    return _nonuniform_norms(TextEncoderLite()).eval()


def _nonuniform_norms(model):
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, LayerNorm):
                mod.gamma.uniform_(0.6, 1.4)
                mod.beta.normal_(0.0, 0.1)
    return model


EXPECT = {
    "target": "make_vits_text_encoder",
    "kind": "multihead",
    "ok": True,
    "layer": "encoder.attn_layers.0",
    "structure": {
        "heads": 4,
        "kv_heads": 4,
        "head_dim": 16,
        "causal": False,
        "cross": False,
        "rope": None,
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "VITS TextEncoder attentions.Encoder: channels-first (b, c, t) 1x1 Conv1d q/k/v/o, "
    "view/transpose(2, 3) heads, query / sqrt(k_channels), masked_fill(mask == 0, -1e4) with an"
    " all-ones x_mask, channels-first LayerNorm",
}

"""Matcha-TTS text encoder MultiHeadAttention (shivammehta25/Matcha-TTS, glow-tts lineage): 1x1 Conv1d q/k/v/o projections on (batch, channels, time), einops head split, rotary embedding (labml-style, rotate-half) on the first half of each head's channels only, -1e4 fill from the sequence mask, post-norm.

This file: (base c08) refused: the differential-attention variant: each head split into two halves, two softmax maps, p1 - lambda * p2 (lambda = 0.5, learned) weights the values."""

import math

import torch
from einops import rearrange
from torch import nn


class LayerNorm(nn.Module):
    """Channel-first LayerNorm (normalises dim 1 of (batch, channels, time))."""

    def __init__(self, channels, eps=1e-4):
        super().__init__()
        self.channels = channels
        self.eps = eps
        self.gamma = nn.Parameter(torch.ones(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x):
        n_dims = len(x.shape)
        mean = torch.mean(x, 1, keepdim=True)
        variance = torch.mean((x - mean) ** 2, 1, keepdim=True)
        x = (x - mean) * torch.rsqrt(variance + self.eps)
        shape = [1, -1] + [1] * (n_dims - 2)
        return x * self.gamma.view(*shape) + self.beta.view(*shape)


class RotaryPositionalEmbeddings(nn.Module):
    """RoPE on the first `d` features of each head (rotate-half layout); the rest pass through."""

    def __init__(self, d, base=10_000):
        super().__init__()
        self.base = base
        self.d = int(d)

    def _tables(self, seq_len, device, dtype):
        theta = 1.0 / (
            self.base ** (torch.arange(0, self.d, 2, dtype=torch.float64, device=device) / self.d)
        )
        seq_idx = torch.arange(seq_len, dtype=torch.float64, device=device)
        idx_theta = torch.einsum("n,d->nd", seq_idx, theta)
        idx_theta2 = torch.cat([idx_theta, idx_theta], dim=1)
        return idx_theta2.cos()[:, None, None, :].to(dtype), idx_theta2.sin()[:, None, None, :].to(
            dtype
        )

    def _neg_half(self, x):
        d_2 = self.d // 2
        return torch.cat([-x[:, :, :, d_2:], x[:, :, :, :d_2]], dim=-1)

    def forward(self, x):
        # x: (batch, heads, time, head_dim) -> (time, batch, heads, head_dim)
        x = rearrange(x, "b h t d -> t b h d")
        cos, sin = self._tables(x.shape[0], x.device, x.dtype)
        x_rope, x_pass = x[..., : self.d], x[..., self.d :]
        neg_half_x = self._neg_half(x_rope)
        x_rope = (x_rope * cos[: x.shape[0]]) + (neg_half_x * sin[: x.shape[0]])
        return rearrange(torch.cat((x_rope, x_pass), dim=-1), "t b h d -> b h t d")


class MultiHeadAttention(nn.Module):
    def __init__(self, channels, out_channels, n_heads, proximal_bias=False, differential=False):
        super().__init__()
        assert channels % n_heads == 0
        self.channels = channels
        self.out_channels = out_channels
        self.n_heads = n_heads
        self.proximal_bias = proximal_bias
        self.differential = differential
        self.k_channels = channels // n_heads
        self.conv_q = nn.Conv1d(channels, channels, 1)
        self.conv_k = nn.Conv1d(channels, channels, 1)
        self.conv_v = nn.Conv1d(channels, channels, 1)
        # rotary on half of every head's channels
        self.query_rotary_pe = RotaryPositionalEmbeddings(self.k_channels * 0.5)
        self.key_rotary_pe = RotaryPositionalEmbeddings(self.k_channels * 0.5)
        self.conv_o = nn.Conv1d(channels, out_channels, 1)
        if differential:
            self.lambda_param = nn.Parameter(torch.tensor(0.5))

    def forward(self, x, c, attn_mask=None):
        q = self.conv_q(x)
        k = self.conv_k(c)
        v = self.conv_v(c)
        x, self.attn = self.attention(q, k, v, mask=attn_mask)
        return self.conv_o(x)

    def attention(self, query, key, value, mask=None):
        b, d, t_s, t_t = (*key.size(), query.size(2))
        query = rearrange(query, "b (h c) t-> b h t c", h=self.n_heads)
        key = rearrange(key, "b (h c) t-> b h t c", h=self.n_heads)
        value = rearrange(value, "b (h c) t-> b h t c", h=self.n_heads)

        if self.differential:
            return self._differential(query, key, value, mask, b, d, t_t)

        query = self.query_rotary_pe(query)
        key = self.key_rotary_pe(key)

        scores = torch.matmul(query, key.transpose(-2, -1)) / math.sqrt(self.k_channels)
        if self.proximal_bias:
            assert t_s == t_t, "Proximal bias is only available for self-attention."
            scores = scores + self._attention_bias_proximal(t_s).to(
                device=scores.device, dtype=scores.dtype
            )
        if mask is not None:
            scores = scores.masked_fill(mask == 0, -1e4)
        p_attn = torch.nn.functional.softmax(scores, dim=-1)
        output = torch.matmul(p_attn, value)
        output = output.transpose(2, 3).contiguous().view(b, d, t_t)
        return output, p_attn

    def _differential(self, query, key, value, mask, b, d, t_t):
        query_1, query_2 = torch.chunk(query, 2, dim=-1)
        key_1, key_2 = torch.chunk(key, 2, dim=-1)
        rot = RotaryPositionalEmbeddings(self.k_channels * 0.25)
        query_1, query_2, key_1, key_2 = rot(query_1), rot(query_2), rot(key_1), rot(key_2)
        scores_1 = torch.matmul(query_1, key_1.transpose(-2, -1)) / math.sqrt(self.k_channels)
        scores_2 = torch.matmul(query_2, key_2.transpose(-2, -1)) / math.sqrt(self.k_channels)
        if mask is not None:
            scores_1 = scores_1.masked_fill(mask == 0, -1e4)
            scores_2 = scores_2.masked_fill(mask == 0, -1e4)
        p_attn = torch.softmax(scores_1, dim=-1) - self.lambda_param * torch.softmax(
            scores_2, dim=-1
        )
        output = torch.matmul(p_attn, value)
        return output.transpose(2, 3).contiguous().view(b, d, t_t), p_attn

    @staticmethod
    def _attention_bias_proximal(length):
        r = torch.arange(length, dtype=torch.float64)
        diff = torch.unsqueeze(r, 0) - torch.unsqueeze(r, 1)
        return torch.unsqueeze(torch.unsqueeze(-torch.log1p(torch.abs(diff)), 0), 0)


class FFN(nn.Module):
    def __init__(self, channels, filter_channels):
        super().__init__()
        self.conv_1 = nn.Conv1d(channels, filter_channels, 1)
        self.conv_2 = nn.Conv1d(filter_channels, channels, 1)

    def forward(self, x, x_mask):
        x = torch.relu(self.conv_1(x * x_mask))
        return self.conv_2(x * x_mask) * x_mask


class Encoder(nn.Module):
    """Matcha-TTS text encoder (post-norm, channel-first); takes (batch, time, channels) embeddings
    and builds the (batch, 1, time, time) attention mask from the sequence mask."""

    def __init__(self, hidden_channels=64, filter_channels=128, n_heads=4, **attn_kwargs):
        super().__init__()
        self.attn_layers = nn.ModuleList(
            [MultiHeadAttention(hidden_channels, hidden_channels, n_heads, **attn_kwargs)]
        )
        self.norm_layers_1 = nn.ModuleList([LayerNorm(hidden_channels)])
        self.ffn_layers = nn.ModuleList([FFN(hidden_channels, filter_channels)])
        self.norm_layers_2 = nn.ModuleList([LayerNorm(hidden_channels)])

    def forward(self, x):
        x = x.transpose(1, 2)  # (b, c, t)
        x_mask = torch.ones(x.size(0), 1, x.size(2), dtype=x.dtype, device=x.device)
        attn_mask = x_mask.unsqueeze(2) * x_mask.unsqueeze(-1)
        for i in range(len(self.attn_layers)):
            x = x * x_mask
            y = self.attn_layers[i](x, x, attn_mask)
            x = self.norm_layers_1[i](x + y)
            y = self.ffn_layers[i](x, x_mask)
            x = self.norm_layers_2[i](x + y)
        return (x * x_mask).transpose(1, 2)


def make_matcha_text_encoder():
    torch.manual_seed(4008)
    model = Encoder(n_heads=4, differential=True)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, LayerNorm):
                mod.gamma.uniform_(0.5, 1.5)
                mod.beta.uniform_(-0.2, 0.2)
            elif isinstance(mod, nn.Conv1d):
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {
    "target": "make_matcha_text_encoder",
    "kind": "multihead",
    "ok": True,
    "layer": "attn_layers.0",
    "unsupported": "differential_attention",
    "style": "Matcha-TTS (r01_matcha_differential_attention): (base c08) refused: the "
    "differential-attention variant: each head split into two halves, two softmax maps, p1 - "
    "lambda * p2 (lambda = 0.5, learned) weights the values",
}

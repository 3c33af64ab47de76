"""Primer (So et al., 'Primer: Searching for Efficient Transformers') multi-dconv-head attention in a
GPT-style block: after the q/k/v Linears each head's channels run through a causal depthwise Conv1d
(kernel 3, left padding) along the sequence, so a query is a mix of its own and the two previous
tokens' projections; then the usual causal scaled dot-product attention (tril buffer, -inf) and c_proj.

This file: refused (queries, keys and values are not per-token projections)."""

import math

import torch
import torch.nn.functional as F
from torch import nn


class DepthwiseCausalConv(nn.Module):
    def __init__(self, channels, kernel_size=3):
        super().__init__()
        self.kernel_size = kernel_size
        self.conv = nn.Conv1d(channels, channels, kernel_size, groups=channels)

    def forward(self, x):  # (B, T, C)
        x = x.transpose(1, 2)
        x = F.pad(x, (self.kernel_size - 1, 0))
        return self.conv(x).transpose(1, 2)


class MDHASelfAttention(nn.Module):
    def __init__(self, n_embd=64, n_head=4, block_size=128):
        super().__init__()
        self.n_head = n_head
        self.q_proj = nn.Linear(n_embd, n_embd)
        self.k_proj = nn.Linear(n_embd, n_embd)
        self.v_proj = nn.Linear(n_embd, n_embd)
        self.q_dconv = DepthwiseCausalConv(n_embd)
        self.k_dconv = DepthwiseCausalConv(n_embd)
        self.v_dconv = DepthwiseCausalConv(n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.register_buffer(
            "bias",
            torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size),
        )

    def forward(self, x):
        B, T, C = x.size()
        q = self.q_dconv(self.q_proj(x))
        k = self.k_dconv(self.k_proj(x))
        v = self.v_dconv(self.v_proj(x))
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class Block(nn.Module):
    def __init__(self, n_embd=64):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = MDHASelfAttention(n_embd)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp_fc = nn.Linear(n_embd, 4 * n_embd)
        self.mlp_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp_proj(F.relu(self.mlp_fc(self.ln_2(x))) ** 2)


def make_primer_block():
    torch.manual_seed(1395)
    model = Block()
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {
    "target": "make_primer_block",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "attn",
    "unsupported": "depthwise_conv_qkv",
    "style": "Primer multi-dconv-head attention: causal depthwise Conv1d (kernel 3) over each of q/k/v after "
    "the projections, then causal softmax attention",
}

"""Umar Jamil pytorch-llama (LLaMA 2 from scratch) style SelfAttention inside the EncoderBlock /
Transformer body: wq/wk/wv/wo without bias, (B, T, H, D) layout, RoPE as complex multiplication
(view_as_complex over consecutive pairs, torch.polar tables precomputed in the model and sliced
[start_pos:start_pos + seq_len]), repeat_kv by expand + reshape, matmul / sqrt(head_dim), additive
mask built by the model (full(-inf) + triu(1) + hstack of cached zeros), softmax, wo.

This file: correct (n_kv_heads=None, so n_rep == 1 and repeat_kv returns its input)."""

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ModelArgs:
    dim: int = 64
    n_layers: int = 1
    n_heads: int = 4
    n_kv_heads: Optional[int] = 2
    multiple_of: int = 32
    norm_eps: float = 1e-5
    max_seq_len: int = 128


def precompute_theta_pos_frequencies(head_dim, seq_len, theta=10000.0):
    assert head_dim % 2 == 0, "Dimension must be divisible by 2"
    # theta_i = 10000 ^ (-2(i-1)/dim) for i = [1, 2, ... dim/2]
    theta_numerator = torch.arange(0, head_dim, 2, dtype=torch.float64)
    theta = 1.0 / (theta ** (theta_numerator / head_dim))
    m = torch.arange(seq_len, dtype=torch.float64)
    freqs = torch.outer(m, theta)
    # c = R * exp(m * theta * i), with R = 1
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_embeddings(x, freqs_complex):
    # (B, T, H, D) -> (B, T, H, D/2) complex: consecutive pairs are (real, imag)
    x_complex = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2))
    # (T, D/2) -> (1, T, 1, D/2)
    freqs_complex = freqs_complex.unsqueeze(0).unsqueeze(2)
    x_rotated = x_complex * freqs_complex
    x_out = torch.view_as_real(x_rotated)
    x_out = x_out.reshape(*x.shape)
    return x_out.type_as(x)


def repeat_kv(x, n_rep):
    batch_size, seq_len, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return (
        x[:, :, :, None, :]
        .expand(batch_size, seq_len, n_kv_heads, n_rep, head_dim)
        .reshape(batch_size, seq_len, n_kv_heads * n_rep, head_dim)
    )


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        return self.weight * self._norm(x)


class SelfAttention(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.n_kv_heads = args.n_heads if args.n_kv_heads is None else args.n_kv_heads
        self.n_heads_q = args.n_heads
        self.n_rep = self.n_heads_q // self.n_kv_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x, start_pos, freqs_complex, mask):
        batch_size, seq_len, _ = x.shape
        xq = self.wq(x)
        xk = self.wk(x)
        xv = self.wv(x)
        xq = xq.view(batch_size, seq_len, self.n_heads_q, self.head_dim)
        xk = xk.view(batch_size, seq_len, self.n_kv_heads, self.head_dim)
        xv = xv.view(batch_size, seq_len, self.n_kv_heads, self.head_dim)
        xq = apply_rotary_embeddings(xq, freqs_complex)
        xk = apply_rotary_embeddings(xk, freqs_complex)
        keys = repeat_kv(xk, self.n_rep)
        values = repeat_kv(xv, self.n_rep)
        xq = xq.transpose(1, 2)
        keys = keys.transpose(1, 2)
        values = values.transpose(1, 2)
        scores = torch.matmul(xq, keys.transpose(2, 3)) / math.sqrt(self.head_dim)
        if mask is not None:
            scores = scores + mask
        scores = F.softmax(scores, dim=-1).type_as(xq)
        output = torch.matmul(scores, values)
        output = output.transpose(1, 2).contiguous().view(batch_size, seq_len, -1)
        return self.wo(output)


class FeedForward(nn.Module):
    def __init__(self, args):
        super().__init__()
        hidden_dim = int(2 * (4 * args.dim) / 3)
        hidden_dim = args.multiple_of * ((hidden_dim + args.multiple_of - 1) // args.multiple_of)
        self.w1 = nn.Linear(args.dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class EncoderBlock(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.attention = SelfAttention(args)
        self.feed_forward = FeedForward(args)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x, start_pos, freqs_complex, mask):
        h = x + self.attention.forward(self.attention_norm(x), start_pos, freqs_complex, mask)
        return h + self.feed_forward.forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.layers = nn.ModuleList([EncoderBlock(args) for _ in range(args.n_layers)])
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.freqs_complex = precompute_theta_pos_frequencies(
            args.dim // args.n_heads, args.max_seq_len * 2
        )

    def forward(self, h, start_pos=0):
        batch_size, seq_len, _ = h.shape
        freqs_complex = self.freqs_complex[start_pos : start_pos + seq_len].to(h.device)
        mask = None
        if seq_len > 1:
            mask = torch.full((seq_len, seq_len), float("-inf"), device=h.device)
            mask = torch.triu(mask, diagonal=1)
            mask = torch.hstack([torch.zeros((seq_len, start_pos), device=h.device), mask]).type_as(
                h
            )
        for layer in self.layers:
            h = layer(h, start_pos, freqs_complex, mask)
        return self.norm(h)


def make_llama():
    torch.manual_seed(1301)
    model = Transformer(ModelArgs(n_kv_heads=None))
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, RMSNorm):
                mod.weight.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {
    "target": "make_llama",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "layers.0.attention",
    "structure": {
        "heads": 4,
        "kv_heads": 4,
        "head_dim": 16,
        "causal": True,
        "cross": False,
        "rope": {"pairing": "interleaved", "fraction": 1.0, "base": 10000},
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "Umar Jamil pytorch-llama SelfAttention with n_kv_heads=None (plain multi-head, n_rep "
    "1), complex RoPE, model-built -inf triu mask",
}

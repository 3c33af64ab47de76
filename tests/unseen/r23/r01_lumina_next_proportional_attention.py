"""Lumina-Next (Alpha-VLLM Lumina-T2X, NextDiT) `Attention`: separate wq/wk/wv/wo without bias, GQA with
n_kv_heads (kv heads repeated in place by unsqueeze(3).repeat(1, 1, 1, n_rep, 1).flatten(2, 3)),
full-width q_norm/k_norm nn.LayerNorm over the whole query / key projection, complex-number RoPE
(precompute_freqs_cis with torch.polar, apply_rotary_emb through view_as_complex: interleaved pairs),
non-causal F.scaled_dot_product_attention with a boolean x_mask and softmax_scale = sqrt(1 / head_dim).
The NextDiT-style block wraps it in attention_norm1 / attention_norm2 (sandwich RMSNorm) and a residual;
the model builds freqs_cis (complex128, per call) and the all-valid x_mask (no adaLN conditioning here).

This file: refused: Lumina-Next's proportional attention, softmax_scale = sqrt(log(seqlen, base_seqlen) / head_dim), a scale that changes with the token count (base_seqlen 16)."""

import math

import torch
import torch.nn.functional as F
from torch import nn


class NextDiTArgs:
    dim = 64
    n_heads = 4
    n_kv_heads = 2
    rope_theta = 10000.0
    norm_eps = 1e-5
    qk_norm = True
    max_len = 128


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        return self._norm(x) * self.weight


def precompute_freqs_cis(dim, end, theta):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64)[: dim // 2] / dim))
    t = torch.arange(end, dtype=torch.float64)
    freqs = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(freqs), freqs)  # complex128, (end, dim // 2)


def apply_rotary_emb(x_in, freqs_cis):
    """x_in: (bsz, seqlen, n_heads, head_dim); freqs_cis: (seqlen, head_dim // 2) complex."""
    x = torch.view_as_complex(x_in.reshape(*x_in.shape[:-1], -1, 2).contiguous())
    freqs_cis = freqs_cis[None, :, None, :].to(x.dtype)
    x_out = torch.view_as_real(x * freqs_cis).flatten(3)
    return x_out.type_as(x_in)


class Attention(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads, qk_norm, norm_eps):
        super().__init__()
        self.n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        self.n_local_heads = n_heads
        self.n_local_kv_heads = self.n_kv_heads
        self.n_rep = self.n_local_heads // self.n_local_kv_heads
        self.head_dim = dim // n_heads

        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

        if qk_norm:
            self.q_norm = nn.LayerNorm(self.n_local_heads * self.head_dim, eps=norm_eps)
            self.k_norm = nn.LayerNorm(self.n_local_kv_heads * self.head_dim, eps=norm_eps)
        else:
            self.q_norm = self.k_norm = nn.Identity()

    def forward(self, x, x_mask, freqs_cis):
        bsz, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        dtype = xq.dtype

        xq = self.q_norm(xq)
        xk = self.k_norm(xk)

        xq = xq.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        xk = xk.view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
        xv = xv.view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)

        xq = apply_rotary_emb(xq, freqs_cis=freqs_cis)
        xk = apply_rotary_emb(xk, freqs_cis=freqs_cis)
        xq, xk = xq.to(dtype), xk.to(dtype)

        # proportional attention: keep the attention entropy of the training length (16 tokens)
        softmax_scale = math.sqrt(math.log(max(seqlen, 1), 16) / self.head_dim)

        n_rep = self.n_local_heads // self.n_local_kv_heads
        if n_rep > 1:
            xk = xk.unsqueeze(3).repeat(1, 1, 1, n_rep, 1).flatten(2, 3)
            xv = xv.unsqueeze(3).repeat(1, 1, 1, n_rep, 1).flatten(2, 3)

        attn_mask = x_mask.bool().view(bsz, 1, 1, seqlen).expand(-1, self.n_local_heads, seqlen, -1)
        output = F.scaled_dot_product_attention(
            xq.permute(0, 2, 1, 3),
            xk.permute(0, 2, 1, 3),
            xv.permute(0, 2, 1, 3),
            attn_mask=attn_mask,
            scale=softmax_scale,
        ).permute(0, 2, 1, 3).to(dtype)
        output = output.flatten(-2)
        return self.wo(output)


class FeedForward(nn.Module):
    def __init__(self, dim, hidden_dim):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.attention = Attention(args.dim, args.n_heads, args.n_kv_heads, args.qk_norm, args.norm_eps)
        self.feed_forward = FeedForward(args.dim, 2 * args.dim)
        self.attention_norm1 = RMSNorm(args.dim, eps=args.norm_eps)
        self.attention_norm2 = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm1 = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm2 = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x, x_mask, freqs_cis):
        x = x + self.attention_norm2(self.attention(self.attention_norm1(x), x_mask, freqs_cis))
        x = x + self.ffn_norm2(self.feed_forward(self.ffn_norm1(x)))
        return x


class NextDiT(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.layers = nn.ModuleList([TransformerBlock(args)])
        self.norm_final = nn.LayerNorm(args.dim, eps=1e-6)
        self.head_dim = args.dim // args.n_heads

    def forward(self, x):
        bsz, seqlen, _ = x.shape
        x_mask = torch.ones(bsz, seqlen, dtype=torch.int32, device=x.device)
        freqs_cis = precompute_freqs_cis(self.head_dim, seqlen, self.args.rope_theta).to(x.device)
        for layer in self.layers:
            x = layer(x, x_mask, freqs_cis)
        return self.norm_final(x)


def make_lumina_next():
    torch.manual_seed(2321)
    model = NextDiT(NextDiTArgs())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, RMSNorm):
                mod.weight.uniform_(0.5, 1.5)
            elif isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.3, 0.3)
    return model.eval()


EXPECT = {
    "target": "make_lumina_next",
    "kind": "multihead",
    "ok": True,
    "layer": "layers.0.attention",
    "unsupported": "length_dependent_scale",
    "style": "Lumina-Next Attention with proportional attention: softmax_scale = sqrt(log_16(seqlen) / head_dim) depends on the sequence length",
}

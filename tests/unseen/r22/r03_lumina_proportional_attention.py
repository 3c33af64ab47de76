"""Alpha-VLLM Lumina-Next (Lumina-T2X `NextDiT`) `Attention`: bias-free `wq`/`wk`/`wv`/`wo`, QK norm as
`nn.LayerNorm` over the whole projection width (n_heads*head_dim for queries, n_kv_heads*head_dim for
keys) before the head view, rotary in complex form (`torch.view_as_complex` on consecutive pairs times
`freqs_cis` from `torch.polar`), GQA by `xk.unsqueeze(3).repeat(1, 1, 1, n_rep, 1).flatten(2, 3)`,
`F.scaled_dot_product_attention` with the token mask `x_mask` and `scale=softmax_scale`; block with
`attention_norm1`/`attention_norm2` sandwich RMSNorms. The caption cross-attention and adaLN
modulation are left out. Non-causal (diffusion transformer).

This file: refused (proportional_attn: softmax scale sqrt(log_16(seqlen) / head_dim) depends on the token count)."""

import math

import torch
import torch.nn.functional as F
from torch import nn


class NextDiTArgs:
    dim = 64
    n_heads = 4
    n_kv_heads = 2
    qk_norm = True
    rope_theta = 10000.0
    norm_eps = 1e-5
    max_len = 256
    attn_impl = "sdpa"


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def precompute_freqs_cis(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64)[: dim // 2] / dim))
    t = torch.arange(end, dtype=torch.float64)
    freqs = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(freqs), freqs)  # complex128


class Attention(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads, qk_norm, attn_impl="sdpa"):
        super().__init__()
        self.n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        self.n_local_heads = n_heads
        self.n_local_kv_heads = self.n_kv_heads
        self.n_rep = self.n_local_heads // self.n_local_kv_heads
        self.head_dim = dim // n_heads
        self.attn_impl = attn_impl
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)
        if qk_norm:
            self.q_norm = nn.LayerNorm(self.n_local_heads * self.head_dim)
            self.k_norm = nn.LayerNorm(self.n_local_kv_heads * self.head_dim)
        else:
            self.q_norm = self.k_norm = nn.Identity()

    @staticmethod
    def apply_rotary_emb(x_in, freqs_cis):
        ctype = torch.complex128 if x_in.dtype == torch.float64 else torch.complex64
        x = torch.view_as_complex(x_in.contiguous().reshape(*x_in.shape[:-1], -1, 2))
        freqs_cis = freqs_cis.to(ctype).unsqueeze(2)
        x_out = torch.view_as_real(x * freqs_cis).flatten(3)
        return x_out.type_as(x_in)

    def _math_attention(self, q, k, v, mask, scale):
        attn = torch.matmul(q, k.transpose(-2, -1)) * scale
        attn = attn.masked_fill(~mask, float("-inf"))
        attn = attn.softmax(dim=-1)
        return torch.matmul(attn, v)

    def forward(self, x, x_mask, freqs_cis):
        bsz, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        dtype = xq.dtype

        xq = self.q_norm(xq)
        xk = self.k_norm(xk)

        xq = xq.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        xk = xk.view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
        xv = xv.view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)

        xq = Attention.apply_rotary_emb(xq, freqs_cis=freqs_cis)
        xk = Attention.apply_rotary_emb(xk, freqs_cis=freqs_cis)
        xq, xk = xq.to(dtype), xk.to(dtype)

        # proportional_attn: the scale grows with log(seqlen) / log(base_seqlen)
        softmax_scale = math.sqrt(math.log(seqlen, 16) / self.head_dim)

        n_rep = self.n_local_heads // self.n_local_kv_heads
        if n_rep >= 1:
            xk = xk.unsqueeze(3).repeat(1, 1, 1, n_rep, 1).flatten(2, 3)
            xv = xv.unsqueeze(3).repeat(1, 1, 1, n_rep, 1).flatten(2, 3)
        mask = x_mask.bool().view(bsz, 1, 1, seqlen).expand(-1, self.n_local_heads, seqlen, -1)
        if self.attn_impl == "sdpa":
            output = F.scaled_dot_product_attention(
                xq.permute(0, 2, 1, 3),
                xk.permute(0, 2, 1, 3),
                xv.permute(0, 2, 1, 3),
                attn_mask=mask,
                scale=softmax_scale,
            ).permute(0, 2, 1, 3).to(dtype)
        else:
            output = self._math_attention(
                xq.permute(0, 2, 1, 3), xk.permute(0, 2, 1, 3), xv.permute(0, 2, 1, 3), mask, softmax_scale
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
        self.attention = Attention(args.dim, args.n_heads, args.n_kv_heads, args.qk_norm, args.attn_impl)
        self.feed_forward = FeedForward(args.dim, 2 * args.dim)
        self.attention_norm1 = RMSNorm(args.dim, eps=args.norm_eps)
        self.attention_norm2 = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm1 = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm2 = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x, x_mask, freqs_cis):
        x = x + self.attention_norm2(self.attention(self.attention_norm1(x), x_mask, freqs_cis))
        return x + self.ffn_norm2(self.feed_forward(self.ffn_norm1(x)))


class NextDiT(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.layers = nn.ModuleList([TransformerBlock(args)])
        self.norm_final = RMSNorm(args.dim, eps=args.norm_eps)
        self.register_buffer(
            "freqs_cis",
            precompute_freqs_cis(args.dim // args.n_heads, args.max_len, args.rope_theta),
            persistent=False,
        )

    def forward(self, x):
        bsz, seqlen, _ = x.shape
        x_mask = torch.ones(bsz, seqlen, dtype=torch.bool, device=x.device)
        freqs_cis = self.freqs_cis[:seqlen]
        freqs_cis = freqs_cis.unsqueeze(0)  # (1, seqlen, head_dim // 2)
        for layer in self.layers:
            x = layer(x, x_mask, freqs_cis)
        return self.norm_final(x)


def make_lumina_next():
    torch.manual_seed(2230)
    model = NextDiT(NextDiTArgs())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, RMSNorm):
                mod.weight.uniform_(0.5, 1.5)
            elif isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {'target': 'make_lumina_next',
 'kind': 'multihead',
 'ok': True,
 'layer': 'layers.0.attention',
 'unsupported': 'length_dependent_scale',
 'style': 'Lumina-Next NextDiT Attention (full-width LayerNorm q/k norm, complex freqs_cis, GQA '
          'repeat, SDPA): proportional_attn: softmax scale sqrt(log_16(seqlen) / head_dim) depends '
          'on the token count'}

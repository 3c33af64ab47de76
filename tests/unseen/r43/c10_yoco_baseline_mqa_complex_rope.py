"""YOCO (microsoft/unilm YOCO, "You Only Cache Once"): the self-decoder's SlidingWindowAttention
(separate q/k/v projections, rotary with interleaved pairs as flash-attn's
`apply_rotary_emb(..., interleaved=True)`, flash `window_size=(sliding_window - 1, 0)`, here run as
an eager or SDPA band), the cross-decoder's grouped-query CrossAttention (queries from the
cross-decoder stream, keys/values from the normalised self-decoder output, n_attn_kv_heads < heads),
and the baseline Transformer attention shipped for comparison (GQA, complex-number rotary, causal).
Pre-norm RMSNorm blocks.

This file: correct."""

import torch
import torch.nn.functional as F
from torch import nn


class YOCOArgs:
    dim = 64
    n_self_heads = 4
    n_attn_heads = 4
    n_attn_kv_heads = 1
    sliding_window = 8
    rope_theta = 500000.0
    norm_eps = 1e-5


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rotary_tables(seqlen, head_dim, theta, dtype, device):
    """cos/sin laid out for interleaved pairs (x0, x1), (x2, x3), ...: each frequency twice in a row."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    freqs = torch.outer(torch.arange(seqlen, dtype=torch.float64), inv_freq)
    emb = freqs.repeat_interleave(2, dim=-1)
    return emb.cos().to(device, dtype), emb.sin().to(device, dtype)


def rotate_every_two(x):
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rotary_emb(x, cos, sin):
    """x: (batch, seqlen, heads, head_dim); cos/sin: (seqlen, head_dim)."""
    return x * cos[:, None, :] + rotate_every_two(x) * sin[:, None, :]


class SlidingWindowAttention(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.embed_dim = args.dim
        self.num_heads = args.n_self_heads
        self.window_size = args.sliding_window
        self.head_dim = args.dim // args.n_self_heads
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(args.dim, args.dim, bias=False)
        self.k_proj = nn.Linear(args.dim, args.dim, bias=False)
        self.v_proj = nn.Linear(args.dim, args.dim, bias=False)
        self.out_proj = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x, rel_pos, attn_mask):
        bsz, tgt_len, _ = x.size()
        q = self.q_proj(x).view(bsz, tgt_len, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(bsz, tgt_len, self.num_heads, self.head_dim)
        v = self.v_proj(x).view(bsz, tgt_len, self.num_heads, self.head_dim)
        cos, sin = rel_pos
        q = apply_rotary_emb(q, cos, sin)
        k = apply_rotary_emb(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if attn_mask.dtype == torch.bool:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        else:
            attn = torch.matmul(q * self.scaling, k.transpose(-1, -2)) + attn_mask
            attn = torch.softmax(attn, dim=-1)
            out = torch.matmul(attn, v)
        out = out.transpose(1, 2).reshape(bsz, tgt_len, self.embed_dim)
        return self.out_proj(out)


class CrossAttention(nn.Module):
    """Cross-decoder attention: queries from x, keys/values from the self-decoder's memory."""

    def __init__(self, args):
        super().__init__()
        self.embed_dim = args.dim
        self.num_heads = args.n_attn_heads
        self.num_kv_heads = args.n_attn_kv_heads
        self.n_rep = self.num_heads // self.num_kv_heads
        self.head_dim = args.dim // args.n_attn_heads
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(args.dim, args.dim, bias=True)
        self.k_proj = nn.Linear(args.dim, self.head_dim * self.num_kv_heads, bias=True)
        self.v_proj = nn.Linear(args.dim, self.head_dim * self.num_kv_heads, bias=True)
        self.out_proj = nn.Linear(args.dim, args.dim, bias=True)

    def forward(self, x, memory):
        bsz, tgt_len, _ = x.size()
        src_len = memory.size(1)
        q = self.q_proj(x).view(bsz, tgt_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(memory).view(bsz, src_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(memory).view(bsz, src_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        k = k[:, :, None].expand(bsz, self.num_kv_heads, self.n_rep, src_len, self.head_dim)
        v = v[:, :, None].expand(bsz, self.num_kv_heads, self.n_rep, src_len, self.head_dim)
        k = k.reshape(bsz, self.num_heads, src_len, self.head_dim)
        v = v.reshape(bsz, self.num_heads, src_len, self.head_dim)
        attn = torch.einsum("bhtd,bhsd->bhts", q * self.scaling, k)
        attn = torch.softmax(attn, dim=-1)
        out = torch.einsum("bhts,bhsd->bthd", attn, v).reshape(bsz, tgt_len, self.embed_dim)
        return self.out_proj(out)


class Attention(nn.Module):
    """Baseline Transformer attention (GQA, complex-number rotary, flash causal -> SDPA)."""

    def __init__(self, args):
        super().__init__()
        self.n_heads = args.n_attn_heads
        self.n_kv_heads = args.n_attn_kv_heads
        self.n_rep = self.n_heads // self.n_kv_heads
        self.head_dim = args.dim // args.n_attn_heads
        self.wq = nn.Linear(args.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, args.dim, bias=False)

    @staticmethod
    def apply_rotary(x, freqs_cis):
        x_ = torch.view_as_complex(x.to(torch.float64).reshape(*x.shape[:-1], -1, 2))
        out = torch.view_as_real(x_ * freqs_cis[None, :, None, :]).flatten(-2)
        return out.to(x.dtype)

    def forward(self, x, freqs_cis):
        bsz, seqlen, _ = x.shape
        xq = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        xk = self.wk(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xv = self.wv(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xq = self.apply_rotary(xq, freqs_cis)
        xk = self.apply_rotary(xk, freqs_cis)
        xq, xk, xv = (t.transpose(1, 2) for t in (xq, xk, xv))
        xk = xk.repeat_interleave(self.n_rep, dim=1)
        xv = xv.repeat_interleave(self.n_rep, dim=1)
        out = F.scaled_dot_product_attention(xq, xk, xv, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class SelfDecoderLayer(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.attn_norm = RMSNorm(args.dim, args.norm_eps)
        self.mixer = SlidingWindowAttention(args)

    def forward(self, x, rel_pos, attn_mask):
        return x + self.mixer(self.attn_norm(x), rel_pos, attn_mask)


class SelfDecoder(nn.Module):
    def __init__(self, args, use_sdpa):
        super().__init__()
        self.args = args
        self.use_sdpa = use_sdpa
        self.layers = nn.ModuleList([SelfDecoderLayer(args)])
        self.norm = RMSNorm(args.dim, args.norm_eps)

    def window_mask(self, seqlen, dtype, device):
        w = self.args.sliding_window
        if self.use_sdpa:
            i = torch.arange(seqlen, device=device)[:, None]
            j = torch.arange(seqlen, device=device)[None, :]
            return ((j <= i) & (i - j < w))[None, None]
        full = torch.full((seqlen, seqlen), torch.finfo(dtype).min, dtype=dtype, device=device)
        band = torch.triu(full, diagonal=1) + torch.tril(full, diagonal=-w)
        return band[None, None]

    def forward(self, x):
        seqlen = x.shape[1]
        head_dim = self.args.dim // self.args.n_self_heads
        rel_pos = rotary_tables(seqlen, head_dim, self.args.rope_theta, x.dtype, x.device)
        mask = self.window_mask(seqlen, x.dtype, x.device)
        for layer in self.layers:
            x = layer(x, rel_pos, mask)
        return self.norm(x)


class CrossDecoderLayer(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.attn_norm = RMSNorm(args.dim, args.norm_eps)
        self.kv_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = CrossAttention(args)

    def forward(self, x, memory):
        return x + self.attention(self.attn_norm(x), self.kv_norm(memory))


class TransformerBlock(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)

    def forward(self, x, freqs_cis):
        return x + self.attention(self.attention_norm(x), freqs_cis)


class BaselineTransformer(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.layers = nn.ModuleList([TransformerBlock(args)])
        self.norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x):
        head_dim = self.args.dim // self.args.n_attn_heads
        inv = 1.0 / (
            self.args.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        )
        angles = torch.outer(torch.arange(x.shape[1], dtype=torch.float64), inv)
        freqs_cis = torch.polar(torch.ones_like(angles), angles).to(x.device)
        for layer in self.layers:
            x = layer(x, freqs_cis)
        return self.norm(x)


def make_yoco_baseline():
    torch.manual_seed(4310)
    model = BaselineTransformer(YOCOArgs())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, RMSNorm):
                mod.weight.uniform_(0.5, 1.5)
            elif isinstance(mod, nn.Linear) and mod.bias is not None:
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {
    "target": "make_yoco_baseline",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "layers.0.attention",
    "structure": {
        "heads": 4,
        "kv_heads": 1,
        "head_dim": 16,
        "causal": True,
        "cross": False,
        "rope": {"pairing": "interleaved", "fraction": 1.0, "base": 500000},
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "YOCO baseline Transformer (c10): correct: MQA 4:1, complex-number (view_as_complex) rotary, theta 5e5, SDPA is_causal",
}

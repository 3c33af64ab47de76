"""Tenstorrent tt-metal style PyTorch reference decoder (the float "reference/model.py" that the
device models are checked against): ModelArgs dataclass, wq/wk/wv/wo projections on a
(batch, seq, heads, head_dim) layout, rotary tables computed by precompute_freqs_cis and sliced by
position, repeat_kv by repeat_interleave on the head axis, an additive mask built once by the
Transformer (torch.log of a 0/1 band, or a finfo.min band) and handed to every layer.

This file: correct (GQA 8:2 of 8, complex-number interleaved RoPE base 1000000.0, sliding
window 6, torch.log mask, SDPA)."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ModelArgs:
    dim: int = 64
    n_layers: int = 1
    n_heads: int = 8
    n_kv_heads: int = 2
    head_dim: int = 8
    hidden_dim: int = 128
    norm_eps: float = 1e-5
    rope_theta: float = 1000000.0
    rotary_dim: int | None = None
    sliding_window: int | None = 6
    max_seq_len: int = 64
    qkv_bias: bool = False
    qk_norm: bool = False
    rope_impl: str = "complex"  # "complex" (Meta checkpoints) or "real" (converted tables)
    mask_impl: str = "log"  # "log" (torch.log of a 0/1 band) or "min" (finfo.min band)
    use_sdpa: bool = True


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        return self._norm(x.float() if x.dtype != torch.float64 else x).type_as(x) * self.weight


def precompute_freqs(dim, end, theta):
    # always float64: the tables are cast to the activation dtype where they are used
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64)[: dim // 2] / dim))
    t = torch.arange(end, dtype=torch.float64)
    return torch.outer(t, freqs)


def precompute_freqs_cis(dim, end, theta):
    freqs = precompute_freqs(dim, end, theta)
    return torch.polar(torch.ones_like(freqs), freqs)  # complex128


def apply_rotary_emb_complex(x, freqs_cis):
    # x: (bsz, seqlen, heads, rot_dim); consecutive pairs (x0, x1), (x2, x3), ... are complex
    ctype = torch.complex128 if x.dtype == torch.float64 else torch.complex64
    real = torch.float64 if ctype == torch.complex128 else torch.float32
    x_ = torch.view_as_complex(x.to(real).reshape(*x.shape[:-1], -1, 2).contiguous())
    freqs_cis = freqs_cis.to(ctype)[None, :, None, :]
    return torch.view_as_real(x_ * freqs_cis).flatten(3).type_as(x)


def rotate_every_two(x):
    x1 = x[..., 0::2]
    x2 = x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def get_rot_mats(freqs, dtype):
    # tables laid out pair by pair to match rotate_every_two: [f0, f0, f1, f1, ...]
    emb = freqs.repeat_interleave(2, dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary_emb_real(x, cos, sin):
    cos = cos[None, :, None, :]
    sin = sin[None, :, None, :]
    return x * cos + rotate_every_two(x) * sin


def repeat_kv(keys, values, repeats):
    keys = torch.repeat_interleave(keys, repeats=repeats, dim=2)
    values = torch.repeat_interleave(values, repeats=repeats, dim=2)
    return keys, values


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.head_dim = args.head_dim
        self.repeats = self.n_heads // self.n_kv_heads
        self.sliding_window = args.sliding_window
        self.rotary_dim = args.rotary_dim or args.head_dim
        self.scale = self.head_dim**-0.5
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=args.qkv_bias)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        if args.qk_norm:
            self.q_norm = RMSNorm(args.head_dim, eps=args.norm_eps)
            self.k_norm = RMSNorm(args.head_dim, eps=args.norm_eps)

    def rotate(self, x, rope, positions):
        rd = self.rotary_dim
        x_rot, x_pass = x[..., :rd], x[..., rd:]
        if self.args.rope_impl == "complex":
            x_rot = apply_rotary_emb_complex(x_rot, rope[positions])
        else:
            cos, sin = get_rot_mats(rope[positions], x.dtype)
            x_rot = apply_rotary_emb_real(x_rot, cos, sin)
        return torch.cat((x_rot, x_pass), dim=-1)

    def forward(self, x, rope, positions, mask: torch.Tensor | None):
        bsz, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bsz, seqlen, self.n_heads, self.head_dim)
        xk = xk.view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xv = xv.view(bsz, seqlen, self.n_kv_heads, self.head_dim)

        if self.args.qk_norm:
            xq = self.q_norm(xq)
            xk = self.k_norm(xk)
        xq = self.rotate(xq, rope, positions)
        xk = self.rotate(xk, rope, positions)

        keys, values = repeat_kv(xk, xv, self.repeats)

        xq = xq.transpose(1, 2)  # (bsz, heads, seqlen, head_dim)
        keys = keys.transpose(1, 2)
        values = values.transpose(1, 2)

        if self.args.use_sdpa:
            output = F.scaled_dot_product_attention(xq, keys, values, attn_mask=mask)
        else:
            scores = torch.matmul(xq, keys.transpose(2, 3)) * self.scale
            if mask is not None:
                scores = scores + mask[None, None, :, :]
            scores = F.softmax(scores.float() if scores.dtype != torch.float64 else scores, dim=-1)
            scores = scores.type_as(xq)
            output = torch.matmul(scores, values)
        output = output.transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        return self.wo(output)


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.hidden_dim, bias=False)
        self.w2 = nn.Linear(args.hidden_dim, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x, rope, positions, mask):
        h = x + self.attention(self.attention_norm(x), rope, positions, mask)
        return h + self.feed_forward(self.ffn_norm(h))


def build_mask(args: ModelArgs, seqlen, dtype, device):
    if args.mask_impl == "log":
        band = torch.full((seqlen, seqlen), fill_value=1.0, dtype=dtype, device=device)
        band = torch.tril(band, diagonal=0)
        if args.sliding_window is not None:
            band = torch.triu(band, diagonal=-(args.sliding_window - 1))
        return torch.log(band)
    neg = torch.finfo(dtype).min
    mask = torch.triu(torch.full((seqlen, seqlen), neg, dtype=dtype, device=device), diagonal=1)
    if args.sliding_window is not None:
        mask = mask + torch.tril(
            torch.full((seqlen, seqlen), neg, dtype=dtype, device=device),
            diagonal=-args.sliding_window,
        )
        mask = mask.clamp(min=neg)
    return mask


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.layers = nn.ModuleList([TransformerBlock(args) for _ in range(args.n_layers)])
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, h, start_pos: int = 0):
        bsz, seqlen, _ = h.shape
        rot = self.args.rotary_dim or self.args.head_dim
        if self.args.rope_impl == "complex":
            rope = precompute_freqs_cis(rot, self.args.max_seq_len * 2, self.args.rope_theta)
        else:
            rope = precompute_freqs(rot, self.args.max_seq_len * 2, self.args.rope_theta)
        positions = torch.arange(start_pos, start_pos + seqlen, device=h.device)
        mask = build_mask(self.args, seqlen, h.dtype, h.device)
        for layer in self.layers:
            h = layer(h, rope, positions, mask)
        return self.norm(h)


def make_tt_reference_model():
    torch.manual_seed(3802)
    model = Transformer(ModelArgs())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, RMSNorm):
                mod.weight.uniform_(0.5, 1.5)
            elif isinstance(mod, nn.Linear) and mod.bias is not None:
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {
    "target": "make_tt_reference_model",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "layers.0.attention",
    "structure": {
        "heads": 8,
        "kv_heads": 2,
        "head_dim": 8,
        "causal": True,
        "cross": False,
        "rope": {"pairing": "interleaved", "fraction": 1.0, "base": 1000000},
        "qk_norm": None,
        "window": 6,
        "bias": None,
    },
    "style": (
        "Tenstorrent tt-metal reference Attention: correct (GQA 8:2 of 8, complex-number "
        "interleaved RoPE base 1000000.0, sliding window 6, torch.log mask, SDPA)"
    ),
}

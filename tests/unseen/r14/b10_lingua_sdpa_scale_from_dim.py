"""Meta lingua (facebookresearch/lingua) BaseTransformer: BaseTransformerArgs dataclass, RotaryEmbedding
buffer of 2x2 rotation matrices [[cos, -sin], [sin, cos]] applied by broadcast-multiply and sum(5)
over adjacent pairs, repeat_kv by expand/reshape, SDPA with mask='causal' -> is_causal, wo.

This file: one bug, an explicit SDPA scale from the model width."""

from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class BaseTransformerArgs:
    dim: int = 64
    n_layers: int = 1
    head_dim: Optional[int] = None
    n_heads: Optional[int] = 4
    n_kv_heads: Optional[int] = 2
    ffn_dim_multiplier: Optional[float] = None
    multiple_of: int = 32
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seqlen: int = 128


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0):
    """Rotation matrices [[cos, -sin], [sin, cos]] per (position, pair of adjacent dims)."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64)[: (dim // 2)] / dim))
    t = torch.arange(end, dtype=torch.float64)
    freqs = torch.outer(t, freqs)
    cos, sin = freqs.cos(), freqs.sin()
    return torch.stack((cos, -sin, sin, cos), dim=-1).view(*freqs.size(), 2, 2)


def reshape_for_broadcast(freqs_cis: torch.Tensor, x: torch.Tensor, seq_dim: int):
    ndim = x.ndim
    assert 0 <= seq_dim < ndim
    assert freqs_cis.shape == (x.shape[seq_dim], x.shape[-3], 2, 2)
    shape = [d if i == seq_dim or i == ndim - 3 else 1 for i, d in enumerate(x.shape[:-2])] + [2, 2]
    return freqs_cis.view(*shape)


def apply_rotary_emb(xq, xk, seq_dim: int, freqs_cis: torch.Tensor):
    xq_ = xq.reshape(*xq.shape[:-1], -1, 1, 2)  # B S H D -> B S H D/2 1 2
    xk_ = xk.reshape(*xk.shape[:-1], -1, 1, 2)
    freqs_cis = reshape_for_broadcast(freqs_cis, xq_, seq_dim).to(xq_.dtype)
    xq_out = (xq_ * freqs_cis).sum(5).flatten(3)
    xk_out = (xk_ * freqs_cis).sum(5).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(x: torch.Tensor, n_rep: int, dim: int) -> torch.Tensor:
    assert dim == 2, "Only dim=2 is supported. Check the implementation for other dims."
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return (
        x[:, :, :, None, :]
        .expand(bs, slen, n_kv_heads, n_rep, head_dim)
        .reshape(bs, slen, n_kv_heads * n_rep, head_dim)
    )


class RotaryEmbedding(nn.Module):
    def __init__(self, theta: float, head_dim: int, max_seqlen: int = 1024):
        super().__init__()
        self.theta = theta
        self.head_dim = head_dim
        self.max_seqlen = max_seqlen
        self.register_buffer(
            "freqs_cis",
            precompute_freqs_cis(dim=head_dim, end=max_seqlen, theta=theta),
            persistent=False,
        )

    def forward(self, seqlen: Optional[int] = None, tok_idx: Optional[torch.Tensor] = None):
        test = (seqlen is not None) or (tok_idx is not None)
        assert test, "Should provide atleast seqlen or tok_idx"
        if tok_idx is not None:
            return self.freqs_cis[tok_idx]
        return self.freqs_cis[0:seqlen]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        return self._norm(x) * self.weight


class Attention(nn.Module):
    def __init__(self, dim: int, head_dim: int, n_heads: int, n_kv_heads: int, rope_theta: float):
        super().__init__()
        self.dim = dim
        self.head_dim = head_dim
        self.rope_theta = rope_theta
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.heads_per_group = self.n_heads // self.n_kv_heads
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        freq_cis: torch.Tensor,
        tok_idx: Optional[torch.Tensor] = None,
        mask: Optional[Union[torch.Tensor, str]] = None,
        attn_impl: str = "sdpa",
    ) -> torch.Tensor:
        bsz, seq_len, dim = x.shape
        xq = self.wq(x.view_as(x))
        xk = self.wk(x.view_as(x))
        xv = self.wv(x.view_as(x))
        output_shape = xq.shape
        xq = xq.view(bsz, seq_len, self.n_heads, self.head_dim)
        xk = xk.view(bsz, seq_len, self.n_kv_heads, self.head_dim)
        xv = xv.view(bsz, seq_len, self.n_kv_heads, self.head_dim)

        xq, xk = apply_rotary_emb(xq, xk, 1, freq_cis[0:seq_len])

        xk = repeat_kv(xk, self.heads_per_group, dim=2)
        xv = repeat_kv(xv, self.heads_per_group, dim=2)

        if attn_impl == "sdpa":
            xq, xk, xv = map(lambda e: e.transpose(1, 2), (xq, xk, xv))
            assert mask is None or isinstance(mask, (str, torch.Tensor))
            is_causal = (mask == "causal") if isinstance(mask, str) else False
            mask = mask if isinstance(mask, torch.Tensor) else None
            output = F.scaled_dot_product_attention(
                xq, xk, xv, is_causal=is_causal, attn_mask=mask, scale=self.dim**-0.5
            )
            output = output.transpose(1, 2).contiguous()  # B H S D -> B S H D
        else:
            raise NotImplementedError(f"Attention implementation {attn_impl} not supported")

        return self.wo(output.reshape(output_shape))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, multiple_of: int):
        super().__init__()
        hidden_dim = int(2 * hidden_dim / 3)
        hidden_dim = multiple_of * ((hidden_dim + multiple_of - 1) // multiple_of)
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: BaseTransformerArgs):
        super().__init__()
        assert (args.head_dim is not None) or (args.n_heads is not None)
        self.head_dim = args.head_dim or args.dim // args.n_heads
        self.n_heads = args.n_heads or args.dim // args.head_dim
        self.n_kv_heads = args.n_kv_heads or self.n_heads
        self.attention = Attention(
            args.dim, self.head_dim, self.n_heads, self.n_kv_heads, args.rope_theta
        )
        self.feed_forward = FeedForward(args.dim, 4 * args.dim, args.multiple_of)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x, freq_cis, tok_idx=None, mask=None, attn_impl="sdpa"):
        h = x + self.attention(
            self.attention_norm(x), freq_cis, tok_idx=tok_idx, mask=mask, attn_impl=attn_impl
        )
        return h + self.feed_forward(self.ffn_norm(h))


class BaseTransformer(nn.Module):
    def __init__(self, args: BaseTransformerArgs):
        super().__init__()
        self.dim = args.dim
        self.max_seqlen = args.max_seqlen
        self.rope_embeddings = RotaryEmbedding(
            theta=args.rope_theta,
            head_dim=args.head_dim or args.dim // args.n_heads,
            max_seqlen=args.max_seqlen,
        )
        self.layers = nn.ModuleList([TransformerBlock(args) for _ in range(args.n_layers)])
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, h, tok_idx=None, mask=None, attn_impl="sdpa"):
        mask = "causal" if mask is None else mask
        freq_cis = self.rope_embeddings(seqlen=self.max_seqlen, tok_idx=tok_idx)
        for layer in self.layers:
            h = layer(h, freq_cis, tok_idx=tok_idx, mask=mask, attn_impl=attn_impl)
        return self.norm(h)


def make_lingua():
    torch.manual_seed(1421)
    model = BaseTransformer(BaseTransformerArgs())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, RMSNorm):
                mod.weight.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {
    "target": "make_lingua",
    "kind": "causal-multihead",
    "ok": False,
    "layer": "layers.0.attention",
    "stage": "scaled_scores",
    "mistake": "wrong_scale",
    "style": "lingua Attention: SDPA given scale=self.dim ** -0.5 (model width 64) instead of the "
    "head_dim default",
}

"""torchtitan-style TransformerBlock in a fork with a per-tensor rotary helper (GQA 8:2, complex rotary theta 5e5);
bug: the rotation is mapped over (xq, xk, xv), so the values are rotated too."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ModelArgs:
    dim: int = 64
    n_heads: int = 8
    n_kv_heads: int = 2
    multiple_of: int = 32
    norm_eps: float = 1e-5
    rope_theta: float = 500000
    max_seq_len: int = 256


def precompute_freqs_cis(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64)[: (dim // 2)] / dim))
    t = torch.arange(end, dtype=torch.float64)
    freqs = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(freqs), freqs)


def rotate(x, freqs_cis):
    """x: (bs, seqlen, heads, head_dim); rotates consecutive pairs as complex numbers."""
    x_ = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
    freqs = freqs_cis[: x.shape[1]].view(1, x.shape[1], 1, x_.shape[-1])
    return torch.view_as_real(x_ * freqs).flatten(3).type_as(x)


def repeat_kv(x, n_rep):
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return (
        x[:, :, :, None, :]
        .expand(bs, slen, n_kv_heads, n_rep, head_dim)
        .reshape(bs, slen, n_kv_heads * n_rep, head_dim)
    )


class Attention(nn.Module):
    def __init__(self, model_args):
        super().__init__()
        self.n_heads = model_args.n_heads
        self.n_kv_heads = (
            model_args.n_heads if model_args.n_kv_heads is None else model_args.n_kv_heads
        )
        self.n_rep = self.n_heads // self.n_kv_heads
        self.head_dim = model_args.dim // model_args.n_heads
        self.wq = nn.Linear(model_args.dim, model_args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(model_args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(model_args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(model_args.n_heads * self.head_dim, model_args.dim, bias=False)

    def forward(self, x, freqs_cis):
        bs, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq, xk, xv = (t.view(bs, seqlen, -1, self.head_dim) for t in (xq, xk, xv))
        xq, xk, xv = (rotate(t, freqs_cis) for t in (xq, xk, xv))

        keys = repeat_kv(xk, self.n_rep)
        values = repeat_kv(xv, self.n_rep)
        output = F.scaled_dot_product_attention(
            xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), is_causal=True
        )
        output = output.transpose(1, 2).contiguous().view(bs, seqlen, -1)
        return self.wo(output)


class FeedForward(nn.Module):
    def __init__(self, dim, hidden_dim, multiple_of):
        super().__init__()
        hidden_dim = int(2 * hidden_dim / 3)
        hidden_dim = multiple_of * ((hidden_dim + multiple_of - 1) // multiple_of)
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """One block that owns its rotary table, so it can run on hidden states alone."""

    def __init__(self, layer_id=0, model_args=None):
        super().__init__()
        model_args = model_args or ModelArgs()
        self.attention = Attention(model_args)
        self.feed_forward = FeedForward(model_args.dim, 4 * model_args.dim, model_args.multiple_of)
        self.attention_norm = nn.RMSNorm(model_args.dim, eps=model_args.norm_eps)
        self.ffn_norm = nn.RMSNorm(model_args.dim, eps=model_args.norm_eps)
        self.register_buffer(
            "freqs_cis",
            precompute_freqs_cis(
                model_args.dim // model_args.n_heads,
                model_args.max_seq_len * 2,
                model_args.rope_theta,
            ),
            persistent=False,
        )

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x), self.freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


EXPECT = {
    "target": "TransformerBlock",
    "kind": "causal-multihead",
    "ok": False,
    "stage": "values",
    "mistake": "rope_on_values",
    "layer": "attention",
    "style": "torchtitan llama Attention/TransformerBlock fork (wq/wk/wv/wo, view_as_complex rotary helper, repeat_kv expand, SDPA is_causal, nn.RMSNorm); rotary mapped over (xq, xk, xv)",
}

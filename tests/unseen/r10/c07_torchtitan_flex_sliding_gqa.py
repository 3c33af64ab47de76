"""torchtitan-style Llama 3 Attention with a sliding-window FlexAttention mask, written from
scratch (flex_attention replaced by a dense torch fallback).

wq/wk/wv/wo without bias, (bs, seqlen, heads, head_dim) layout, complex freqs_cis on adjacent
pairs via reshape_for_broadcast, repeat_kv on dim 2 with torch.expand, GQA 4:2, rope theta
500000, window 8 from the model args ("sliding_window" mask_mod and-ed with causal).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ModelArgs:
    dim: int = 64
    n_heads: int = 4
    n_kv_heads: int = 2
    rope_theta: float = 500000.0
    max_seq_len: int = 128
    sliding_window: int = 8
    norm_eps: float = 1e-5


def precompute_freqs_cis(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].double() / dim))
    t = torch.arange(end, device=freqs.device).double()
    freqs = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(freqs), freqs)


def reshape_for_broadcast(freqs_cis, x):
    ndim = x.ndim
    seqlen = x.shape[1]
    freqs_cis = freqs_cis[0:seqlen]
    shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.view(*shape)


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.double().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.double().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = reshape_for_broadcast(freqs_cis, xq_)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(x, n_rep):
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return (
        torch.unsqueeze(x, dim=3)
        .expand(bs, slen, n_kv_heads, n_rep, head_dim)
        .reshape(bs, slen, n_kv_heads * n_rep, head_dim)
    )


def get_causal_mask_mod():
    def causal_mask(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    return causal_mask


def get_sliding_window_mask_mod(window_size):
    def sliding_window_mask(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < window_size

    return sliding_window_mask


def and_masks(*mods):
    def combined(b, h, q_idx, kv_idx):
        keep = mods[0](b, h, q_idx, kv_idx)
        for m in mods[1:]:
            keep = keep & m(b, h, q_idx, kv_idx)
        return keep

    return combined


def create_dense_block_mask(mask_mod, B, H, Q_LEN, KV_LEN):
    b = torch.arange(B).view(B, 1, 1, 1)
    h = torch.arange(H).view(1, H, 1, 1)
    q_idx = torch.arange(Q_LEN).view(1, 1, Q_LEN, 1)
    kv_idx = torch.arange(KV_LEN).view(1, 1, 1, KV_LEN)
    return mask_mod(b, h, q_idx, kv_idx).expand(B, H, Q_LEN, KV_LEN)


class FlexAttentionFallback(nn.Module):
    def forward(self, q, k, v, block_mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=block_mask)


class Attention(nn.Module):
    def __init__(self, model_args):
        super().__init__()
        self.n_heads = model_args.n_heads
        self.n_kv_heads = model_args.n_kv_heads
        self.n_rep = self.n_heads // self.n_kv_heads
        self.head_dim = model_args.dim // model_args.n_heads
        self.wq = nn.Linear(model_args.dim, model_args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(model_args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(model_args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(model_args.n_heads * self.head_dim, model_args.dim, bias=False)
        self.sdpa = FlexAttentionFallback()

    def forward(self, x, freqs_cis, block_mask):
        bs, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bs, seqlen, -1, self.head_dim)
        xk = xk.view(bs, seqlen, -1, self.head_dim)
        xv = xv.view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
        keys = repeat_kv(xk, self.n_rep)
        values = repeat_kv(xv, self.n_rep)
        xq = xq.transpose(1, 2)
        xk = keys.transpose(1, 2)
        xv = values.transpose(1, 2)
        output = self.sdpa(xq, xk, xv, block_mask)
        output = output.transpose(1, 2).contiguous()
        output = output.view(bs, seqlen, -1)
        return self.wo(output)


class TransformerBlock(nn.Module):
    def __init__(self, model_args):
        super().__init__()
        self.attention = Attention(model_args)
        self.attention_norm = nn.RMSNorm(model_args.dim, eps=model_args.norm_eps)

    def forward(self, x, freqs_cis, block_mask):
        return x + self.attention(self.attention_norm(x), freqs_cis, block_mask)


class Transformer(nn.Module):
    def __init__(self, model_args):
        super().__init__()
        self.model_args = model_args
        self.register_buffer(
            "freqs_cis",
            precompute_freqs_cis(
                model_args.dim // model_args.n_heads, model_args.max_seq_len, model_args.rope_theta
            ),
            persistent=False,
        )
        self.layers = nn.ModuleDict({"0": TransformerBlock(model_args)})
        self.norm = nn.RMSNorm(model_args.dim, eps=model_args.norm_eps)

    def forward(self, h):
        bs, seqlen, _ = h.shape
        mask_mod = and_masks(
            get_causal_mask_mod(), get_sliding_window_mask_mod(self.model_args.sliding_window)
        )
        block_mask = create_dense_block_mask(mask_mod, bs, 1, seqlen, seqlen)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis, block_mask)
        return self.norm(h)


def make_torchtitan():
    torch.manual_seed(1007)
    model = Transformer(ModelArgs())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.RMSNorm):
                mod.weight.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {
    "target": "make_torchtitan",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "layers.0.attention",
    "structure": {
        "heads": 4,
        "kv_heads": 2,
        "head_dim": 16,
        "causal": True,
        "cross": False,
        "rope": {"pairing": "interleaved", "fraction": 1.0, "base": 500000},
        "qk_norm": None,
        "window": 8,
        "bias": None,
    },
    "style": "torchtitan Llama 3 Attention (wq/wk/wv/wo, complex freqs_cis via reshape_for_broadcast, repeat_kv unsqueeze(3).expand, "
    "GQA 4:2) with a FlexAttention-style and_masks(causal, sliding window 8) mask_mod materialised densely; ModuleDict layers",
}

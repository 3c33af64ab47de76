"""torchtitan-style attention with flex-attention mask_mods (causal AND sliding window of 5) materialized into an
additive mask for the SDPA backend (GQA 4:2, complex rotary); bug: the causal mask_mod is written q_idx > kv_idx,
so every query is hidden from its own key (the first query then sees only masked keys)."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ModelArgs:
    dim: int = 64
    n_heads: int = 4
    n_kv_heads: int = 2
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 256
    sliding_window: int = 5


# ----------------------------------------------------------------------------- mask_mods
def causal_mask(b, h, q_idx, kv_idx):
    return q_idx > kv_idx


def sliding_window_mask(window_size):
    def _sliding_window(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < window_size

    _sliding_window.__name__ = f"sliding_window_{window_size}"
    return _sliding_window


def and_masks(*mask_mods):
    def _and(b, h, q_idx, kv_idx):
        result = torch.ones((), dtype=torch.bool)
        for mod in mask_mods:
            result = result & mod(b, h, q_idx, kv_idx)
        return result

    return _and


def create_dense_mask(mask_mod, q_len, kv_len, device=None):
    q_idx = torch.arange(q_len, device=device).view(-1, 1)
    kv_idx = torch.arange(kv_len, device=device).view(1, -1)
    return mask_mod(None, None, q_idx, kv_idx)


# ----------------------------------------------------------------------------- rotary
def precompute_freqs_cis(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64)[: (dim // 2)] / dim))
    freqs = torch.outer(torch.arange(end, dtype=torch.float64), freqs)
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis[: xq.shape[1]].view(1, xq.shape[1], 1, -1)
    return (
        torch.view_as_real(xq_ * freqs_cis).flatten(3).type_as(xq),
        torch.view_as_real(xk_ * freqs_cis).flatten(3).type_as(xk),
    )


class FlexAttentionSDPAFallback(nn.Module):
    """Runs a mask_mod through SDPA: the block mask is materialized densely as an additive bias."""

    def __init__(self, mask_mod):
        super().__init__()
        self.mask_mod = mask_mod

    def forward(self, q, k, v):
        keep = create_dense_mask(self.mask_mod, q.shape[-2], k.shape[-2], device=q.device)
        bias = torch.zeros(keep.shape, dtype=q.dtype, device=q.device).masked_fill(
            ~keep, torch.finfo(q.dtype).min
        )
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)


class Attention(nn.Module):
    def __init__(self, model_args):
        super().__init__()
        self.n_heads = model_args.n_heads
        self.n_kv_heads = model_args.n_kv_heads
        self.head_dim = model_args.dim // model_args.n_heads
        self.wq = nn.Linear(model_args.dim, model_args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(model_args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(model_args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(model_args.n_heads * self.head_dim, model_args.dim, bias=False)
        self.sdpa = FlexAttentionSDPAFallback(
            and_masks(causal_mask, sliding_window_mask(model_args.sliding_window))
        )

    def forward(self, x, freqs_cis):
        bs, seqlen, _ = x.shape
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
        output = self.sdpa(xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2))
        output = output.transpose(1, 2).contiguous().view(bs, seqlen, -1)
        return self.wo(output)


class TransformerBlock(nn.Module):
    def __init__(self, model_args):
        super().__init__()
        self.attention = Attention(model_args)
        self.attention_norm = nn.RMSNorm(model_args.dim, eps=model_args.norm_eps)
        self.ffn_norm = nn.RMSNorm(model_args.dim, eps=model_args.norm_eps)
        self.feed_forward = nn.Sequential(
            nn.Linear(model_args.dim, 4 * model_args.dim, bias=False),
            nn.SiLU(),
            nn.Linear(4 * model_args.dim, model_args.dim, bias=False),
        )

    def forward(self, x, freqs_cis):
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, model_args):
        super().__init__()
        self.model_args = model_args
        self.register_buffer(
            "freqs_cis",
            precompute_freqs_cis(
                model_args.dim // model_args.n_heads,
                model_args.max_seq_len * 2,
                model_args.rope_theta,
            ),
            persistent=False,
        )
        self.layers = nn.ModuleDict({"0": TransformerBlock(model_args)})
        self.norm = nn.RMSNorm(model_args.dim, eps=model_args.norm_eps)

    def forward(self, h):
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.norm(h)


def make_model():
    return Transformer(ModelArgs())


EXPECT = {
    "target": "make_model",
    "kind": "causal-multihead",
    "ok": False,
    "stage": "masked_scores",
    "mistake": "mask_diagonal",
    "layer": "layers.0.attention",
    "style": "torchtitan Attention with flex-attention mask_mods (and_masks(causal_mask, sliding_window_mask(5))) materialized for SDPA as an additive finfo.min bias, view_as_complex rotary, enable_gqa; causal_mask_mod uses q_idx > kv_idx",
}

"""Seed-VC (Plachtaa) diffusion-transformer / AR attention, after the gpt-fast derived
modules/gpt_fast/model.py that Seed-VC builds its DiT on: one fused wqkv projection split into
(n_head, n_local_heads, n_local_heads) heads, rotary embedding applied as complex pairs
(interleaved: features 2i and 2i+1 turn together) from a freqs_cis table, keys/values expanded with
repeat_interleave for grouped heads, optional per-head q/k RMSNorm (a configuration option here),
out projection wo. Shrunk to dim 64.
Configuration: the AR (causal) path: 4 query heads, one key/value head, per-head q_norm/k_norm before the rotation, rope base 1e5, boolean tril mask, eager core over a rolling key/value buffer.

This file: one bug: q_norm/k_norm moved below apply_rotary_emb: the per-head RMSNorm (non-uniform gain) acts on the rotated heads"""

import math

import torch
from torch import nn
import torch.nn.functional as F


class ModelArgs:
    dim = 64
    n_layer = 1
    n_head = 4
    n_local_heads = 1
    intermediate_size = 128
    rope_base = 100000.0
    norm_eps = 1e-5
    qk_norm = True
    is_causal = True
    n_mem_kv = 0
    attn_impl = "eager"

    @property
    def head_dim(self):
        return self.dim // self.n_head


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + self.eps) * self.weight


def precompute_freqs_cis(seq_len, n_elem, base, dtype):
    # built in float64 on every call, cast at the end
    freqs = 1.0 / (
        base ** (torch.arange(0, n_elem, 2, dtype=torch.float64)[: n_elem // 2] / n_elem)
    )
    t = torch.arange(seq_len, dtype=torch.float64)
    freqs = torch.outer(t, freqs)
    freqs_cis = torch.polar(torch.ones_like(freqs), freqs)
    cache = torch.stack([freqs_cis.real, freqs_cis.imag], dim=-1)
    return cache.to(dtype)


def apply_rotary_emb(x, freqs_cis):
    # x: (bsz, seqlen, heads, head_dim); freqs_cis: (seqlen, head_dim // 2, 2)
    xshaped = x.reshape(*x.shape[:-1], -1, 2)
    freqs_cis = freqs_cis.view(1, xshaped.size(1), 1, xshaped.size(3), 2)
    x_out = torch.stack(
        [
            xshaped[..., 0] * freqs_cis[..., 0] - xshaped[..., 1] * freqs_cis[..., 1],
            xshaped[..., 1] * freqs_cis[..., 0] + xshaped[..., 0] * freqs_cis[..., 1],
        ],
        -1,
    )
    return x_out.flatten(3).type_as(x)


class Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        total_head_dim = (config.n_head + 2 * config.n_local_heads) * config.head_dim
        self.wqkv = nn.Linear(config.dim, total_head_dim, bias=False)
        self.wo = nn.Linear(config.n_head * config.head_dim, config.dim, bias=False)
        self.n_head = config.n_head
        self.head_dim = config.head_dim
        self.n_local_heads = config.n_local_heads
        self.dim = config.dim
        self.attn_impl = config.attn_impl
        self.qk_norm = config.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.norm_eps)
        self.n_mem_kv = config.n_mem_kv
        if self.n_mem_kv:
            self.mem_k = nn.Parameter(torch.randn(self.n_local_heads, self.n_mem_kv, self.head_dim))
            self.mem_v = nn.Parameter(torch.randn(self.n_local_heads, self.n_mem_kv, self.head_dim))

    def forward(self, x, freqs_cis, mask, input_pos):
        bsz, seqlen, _ = x.shape
        kv_size = self.n_local_heads * self.head_dim
        q, k, v = self.wqkv(x).split([self.dim, kv_size, kv_size], dim=-1)

        q = q.view(bsz, seqlen, self.n_head, self.head_dim)
        k = k.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        v = v.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        q = apply_rotary_emb(q, freqs_cis)
        k = apply_rotary_emb(k, freqs_cis)
        if self.qk_norm:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q, k, v = map(lambda t: t.transpose(1, 2), (q, k, v))
        if self.attn_impl == "eager":
            # rolling key/value buffer, one slot per position, written in place (gpt-fast KVCache style)
            cache_len = seqlen
            k_cache = k.new_zeros(bsz, self.n_local_heads, cache_len, self.head_dim)
            v_cache = v.new_zeros(bsz, self.n_local_heads, cache_len, self.head_dim)
            k_cache[:, :, input_pos % cache_len] = k
            v_cache[:, :, input_pos % cache_len] = v
            k, v = k_cache, v_cache
        n_rep = self.n_head // self.n_local_heads
        k = k.repeat_interleave(n_rep, dim=1)
        v = v.repeat_interleave(n_rep, dim=1)

        if self.attn_impl == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0)
        else:
            scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.head_dim)
            scores = scores.masked_fill(~mask, float("-inf"))
            attn = torch.softmax(scores, dim=-1)
            y = torch.matmul(attn, v)

        y = y.transpose(1, 2).contiguous().view(bsz, seqlen, self.dim)
        return self.wo(y)


class FeedForward(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.intermediate_size, bias=False)
        self.w3 = nn.Linear(config.dim, config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention = Attention(config)
        self.feed_forward = FeedForward(config)
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)

    def forward(self, x, freqs_cis, mask, input_pos):
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask, input_pos)
        return h + self.feed_forward(self.ffn_norm(h))


def sequence_mask(length, max_length):
    x = torch.arange(max_length, dtype=length.dtype, device=length.device)
    return x.unsqueeze(0) < length.unsqueeze(1)


class Transformer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList([TransformerBlock(config) for _ in range(config.n_layer)])
        self.norm = RMSNorm(config.dim, config.norm_eps)

    def forward(self, x, x_lens=None):
        bsz, seqlen, _ = x.shape
        input_pos = torch.arange(seqlen, device=x.device)
        freqs_cis = precompute_freqs_cis(
            seqlen, self.config.head_dim, self.config.rope_base, x.dtype
        )
        if self.config.is_causal:
            mask = torch.ones(seqlen, seqlen, dtype=torch.bool, device=x.device).tril()[None, None]
        else:
            if x_lens is None:
                x_lens = torch.full((bsz,), seqlen, dtype=torch.long, device=x.device)
            key_valid = sequence_mask(x_lens, seqlen)  # (bsz, seqlen)
            mask = key_valid[:, None, None, :]
        for layer in self.layers:
            x = layer(x, freqs_cis, mask, input_pos)
        return self.norm(x)


def make_seedvc_transformer():
    torch.manual_seed(5106)
    model = Transformer(ModelArgs())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, RMSNorm):
                mod.weight.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {
    "target": "make_seedvc_transformer",
    "kind": "causal-multihead",
    "ok": False,
    "layer": "layers.0.attention",
    "stage": "normed_queries",
    "mistake": "qk_norm_misplaced",
    "style": "Seed-VC (Plachtaa) gpt-fast attention: one bug: q_norm/k_norm moved below "
    "apply_rotary_emb: the per-head RMSNorm (non-uniform gain) acts on the rotated heads",
}

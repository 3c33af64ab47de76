"""hertz-dev (Standard Intelligence) latent transformer attention, as in its `transformer.py`:
one fused qkv projection split into query / key / value heads, grouped key/value heads broadcast
to the query heads, interleaved-pair rotary (base 10000, 1 of each head) rotary tables built per call, no QK norm, eager attention through a static key/value cache.
Pre-norm residual block, the model builds the position table and the boolean mask.

This file: one bug: the values are rotated with the keys' table as well."""

import math

import torch
import torch.nn.functional as F
from torch import nn


class HertzConfig:
    d_model = 64
    n_heads = 4
    n_kv_heads = 1
    rope_theta = 10000.0
    rotary_fraction = 1.0
    sliding_window = None
    position_offset = 0
    qk_norm = False
    ff_mult = 2
    eps = 1e-5


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        scale = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return x * scale * self.weight


def rotary_table(n_pos, rot_dim, theta, offset, dtype, device):
    # built in float64 every call, cast at the end
    exps = torch.arange(0, rot_dim, 2, dtype=torch.float64, device=device) / rot_dim
    inv_freq = theta ** (-exps)
    pos = torch.arange(offset, offset + n_pos, dtype=torch.float64, device=device)
    angles = torch.outer(pos, inv_freq)
    cos = angles.cos().repeat_interleave(2, dim=-1)
    sin = angles.sin().repeat_interleave(2, dim=-1)
    return cos.to(dtype), sin.to(dtype)


def apply_rotary(x, cos, sin, rot_dim):
    # adjacent feature pairs (2i, 2i+1) rotate together, as in the complex-number form
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    cos = cos[None, :, None, :]
    sin = sin[None, :, None, :]
    x1 = x_rot[..., 0::2]
    x2 = x_rot[..., 1::2]
    turned = torch.stack((-x2, x1), dim=-1).flatten(-2)
    return torch.cat((x_rot * cos + turned * sin, x_pass), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        self.rot_dim = int(self.head_dim * cfg.rotary_fraction)
        self.split_sizes = [
            self.n_heads * self.head_dim,
            self.n_kv_heads * self.head_dim,
            self.n_kv_heads * self.head_dim,
        ]
        self.qkv = nn.Linear(cfg.d_model, sum(self.split_sizes), bias=False)
        self.proj = nn.Linear(self.n_heads * self.head_dim, cfg.d_model, bias=False)
        self.use_qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.eps)

    def forward(self, x, rope, mask):
        bsz, seqlen, _ = x.shape
        q, k, v = self.qkv(x).split(self.split_sizes, dim=-1)
        q = q.view(bsz, seqlen, self.n_heads, self.head_dim)
        k = k.view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        v = v.view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        cos, sin = rope  # one spare row at the end, for the next decoding step
        q_cos, q_sin = cos[:seqlen], sin[:seqlen]
        k_cos, k_sin = cos[:seqlen], sin[:seqlen]
        if self.use_qk_norm:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = apply_rotary(q, q_cos, q_sin, self.rot_dim)
        k = apply_rotary(k, k_cos, k_sin, self.rot_dim)
        v = apply_rotary(v, k_cos, k_sin, self.rot_dim)

        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        n_rep = self.n_heads // self.n_kv_heads
        if n_rep > 1:
            k = k.repeat_interleave(n_rep, dim=1)
            v = v.repeat_interleave(n_rep, dim=1)
        # static cache: this call's keys/values written at input_pos, read back up to seqlen
        input_pos = torch.arange(seqlen, device=x.device)
        k_cache = k.new_zeros(bsz, self.n_heads, seqlen, self.head_dim)
        v_cache = v.new_zeros(bsz, self.n_heads, seqlen, self.head_dim)
        k_cache[:, :, input_pos] = k
        v_cache[:, :, input_pos] = v
        k, v = k_cache, v_cache
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1)
        out = torch.matmul(probs, v)
        out = out.transpose(1, 2).reshape(bsz, seqlen, self.n_heads * self.head_dim)
        return self.proj(out)


class FeedForward(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        hidden = cfg.d_model * cfg.ff_mult
        self.w_in = nn.Linear(cfg.d_model, 2 * hidden, bias=False)
        self.w_out = nn.Linear(hidden, cfg.d_model, bias=False)

    def forward(self, x):
        a, gate = self.w_in(x).chunk(2, dim=-1)
        return self.w_out(a * F.silu(gate))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.eps)
        self.attn = Attention(cfg)
        self.ff_norm = RMSNorm(cfg.d_model, cfg.eps)
        self.ff = FeedForward(cfg)

    def forward(self, x, rope, mask):
        x = x + self.attn(self.attn_norm(x), rope, mask)
        return x + self.ff(self.ff_norm(x))


class HertzTransformer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList([Block(cfg)])
        self.norm = RMSNorm(cfg.d_model, cfg.eps)

    def build_mask(self, seqlen, device):
        i = torch.arange(seqlen, device=device)[:, None]
        j = torch.arange(seqlen, device=device)[None, :]
        allowed = j <= i
        return allowed[None, None]

    def forward(self, x):
        seqlen = x.shape[1]
        attn = self.layers[0].attn
        rope = rotary_table(
            seqlen + 1, attn.rot_dim, self.cfg.rope_theta, self.cfg.position_offset, x.dtype, x.device
        )
        mask = self.build_mask(seqlen, x.device)
        for layer in self.layers:
            x = layer(x, rope, mask)
        return self.norm(x)


def make_hertz_transformer():
    torch.manual_seed(5201)
    model = HertzTransformer(HertzConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, RMSNorm):
                mod.weight.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {
    "target": "make_hertz_transformer",
    "kind": "causal-multihead",
    "ok": False,
    "layer": "layers.0.attn",
    "stage": "values",
    "mistake": "rope_on_values",
    "style": "hertz-dev (Standard Intelligence) attention: one bug: the values are rotated with the keys' table as well (twin: c01)",
}

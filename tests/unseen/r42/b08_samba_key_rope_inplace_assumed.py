"""Samba (microsoft/Samba, lit_gpt/model.py) hybrid layer: the sliding-window attention block of the
Mamba/SWA stack. One fused `attn` projection laid out per query group (q_per_kv query heads, one key,
one value), lit-gpt rotary (cat(theta, theta) tables, rotate-half) on the first rotary_percentage of
each head, GQA by repeat_interleave, `proj` back to the residual. The flash path (window_size =
(local_window - 1, 0)) needs CUDA and half precision; here the model builds the band mask itself.

This file: one bug: ported from the fused kernel call apply_rotary_emb_func(k, cos, sin, False, True) (inplace=True): the key rotation's result is discarded, keys are not rotated."""

import math

import torch
import torch.nn.functional as F
from torch import nn


class Config:
    n_embd = 64
    n_head = 8
    n_query_groups = 1
    head_size = 8
    bias = True
    rotary_percentage = 1.0
    rope_base = 10000
    local_window = 6
    full_per_layer = 2
    attn_impl = "sdpa"
    intermediate_size = 128
    norm_eps = 1e-5


class RMSNorm(nn.Module):
    def __init__(self, size, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        norm_x = torch.mean(x * x, dim=-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(norm_x + self.eps))


def build_rope_cache(seq_len, n_elem, dtype, device, base=10000):
    # theta_i = base^(-2i/d), built in float64 on every call and cast to the activations' dtype
    theta = 1.0 / (
        base ** (torch.arange(0, n_elem, 2, dtype=torch.float64, device=device) / n_elem)
    )
    seq_idx = torch.arange(seq_len, dtype=torch.float64, device=device)
    idx_theta = torch.outer(seq_idx, theta)
    idx_theta = torch.cat((idx_theta, idx_theta), dim=-1)
    return torch.cos(idx_theta).to(dtype), torch.sin(idx_theta).to(dtype)


def apply_rope(x, cos, sin):
    # x: (B, T, nh, n_elem); cos/sin: (T, n_elem)
    head_size = x.size(-1)
    x1 = x[..., : head_size // 2]
    x2 = x[..., head_size // 2 :]
    rotated = torch.cat((-x2, x1), dim=-1)
    cos = cos[None, :, None, :]
    sin = sin[None, :, None, :]
    return (x * cos) + (rotated * sin)


def local_band_mask(T, window, dtype, device):
    """Additive mask for a causal sliding window: query i keeps keys i - window + 1 .. i
    (flash_attn window_size=(window - 1, 0))."""
    i = torch.arange(T, device=device)[:, None]
    j = torch.arange(T, device=device)[None, :]
    keep = (j <= i) & (i - j < window)
    mask = torch.zeros(T, T, dtype=dtype, device=device)
    return mask.masked_fill(~keep, torch.finfo(dtype).min)[None, None]


def blockwise_local_attention(q, k, v, window, scale):
    """Chunked sliding-window attention: queries in blocks of `window`, each block sees its own block
    and the one before it; the exact band is cut out of the 2*window keys with a position mask."""
    B, nh, T, hs = q.shape
    w = window
    pad = (-T) % w
    qp, kp, vp = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    nb = (T + pad) // w
    qb = qp.view(B, nh, nb, w, hs)
    kb = kp.view(B, nh, nb, w, hs)
    vb = vp.view(B, nh, nb, w, hs)
    k_prev = F.pad(kb, (0, 0, 0, 0, 1, 0))[:, :, :-1]
    v_prev = F.pad(vb, (0, 0, 0, 0, 1, 0))[:, :, :-1]
    kk = torch.cat((k_prev, kb), dim=3)
    vv = torch.cat((v_prev, vb), dim=3)
    att = torch.einsum("bhnqd,bhnkd->bhnqk", qb, kk) * scale
    qpos = torch.arange(nb * w, device=q.device).view(nb, w)
    kpos = torch.cat((qpos - w, qpos), dim=1)
    delta = qpos[:, :, None] - kpos[:, None, :]
    keep = (delta >= 0) & (delta < w) & (kpos[:, None, :] >= 0)
    att = att.masked_fill(~keep, torch.finfo(att.dtype).min)
    att = torch.softmax(att, dim=-1)
    y = torch.einsum("bhnqk,bhnkd->bhnqd", att, vv)
    return y.reshape(B, nh, nb * w, hs)[:, :, :T]


class CausalSelfAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.local = layer_idx % config.full_per_layer < config.full_per_layer - 1
        self.head_size = config.head_size
        self.n_head = config.n_head
        self.n_query_groups = config.n_query_groups
        shape = (self.n_head + 2 * self.n_query_groups) * self.head_size
        self.attn = nn.Linear(config.n_embd, shape, bias=config.bias)
        self.proj = nn.Linear(self.n_head * self.head_size, config.n_embd, bias=config.bias)
        self.config = config

    def forward(self, x, rope, mask=None):
        B, T, C = x.size()
        qkv = self.attn(x)
        q_per_kv = self.n_head // self.n_query_groups
        total_qkv = q_per_kv + 2
        qkv = qkv.view(B, T, self.n_query_groups, total_qkv, self.head_size)
        q, k, v = qkv.split((q_per_kv, 1, 1), dim=-2)
        q = q.reshape(B, T, -1, self.head_size)
        k = k.reshape(B, T, -1, self.head_size)
        v = v.reshape(B, T, -1, self.head_size)

        cos, sin = rope
        n_elem = cos.size(-1)
        q = torch.cat((apply_rope(q[..., :n_elem], cos, sin), q[..., n_elem:]), dim=-1)
        apply_rope(k[..., :n_elem], cos, sin)  # fused kernel rotates k in place (inplace=True)

        y = self.scaled_dot_product_attention(q, k, v, mask=mask)
        y = y.reshape(B, T, -1)
        return self.proj(y)

    def scaled_dot_product_attention(self, q, k, v, mask=None):
        scale = 1.0 / math.sqrt(self.head_size)
        q = q.transpose(1, 2)
        k = k.transpose(1, 2)
        v = v.transpose(1, 2)
        if q.size() != k.size():
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        impl = self.config.attn_impl
        if impl == "blockwise" and self.local:
            y = blockwise_local_attention(q, k, v, self.config.local_window, scale)
        elif impl == "eager":
            att = (q @ k.transpose(-2, -1)) * scale
            if mask is None:
                T = q.size(-2)
                causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
                mask = torch.zeros(T, T, dtype=att.dtype, device=att.device)
                mask = mask.masked_fill(~causal, torch.finfo(att.dtype).min)
            att = att + mask
            att = torch.softmax(att, dim=-1)
            y = att @ v
        else:
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=0.0, scale=scale, is_causal=mask is None
            )
        return y.transpose(1, 2)


class LLaMAMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.fc_1 = nn.Linear(config.n_embd, config.intermediate_size, bias=False)
        self.fc_2 = nn.Linear(config.n_embd, config.intermediate_size, bias=False)
        self.proj = nn.Linear(config.intermediate_size, config.n_embd, bias=False)

    def forward(self, x):
        return self.proj(F.silu(self.fc_1(x)) * self.fc_2(x))


class Block(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.norm_1 = RMSNorm(config.n_embd, eps=config.norm_eps)
        self.attn = CausalSelfAttention(config, layer_idx)
        self.norm_2 = RMSNorm(config.n_embd, eps=config.norm_eps)
        self.mlp = LLaMAMLP(config)

    def forward(self, x, rope, mask):
        x = x + self.attn(self.norm_1(x), rope, mask)
        return x + self.mlp(self.norm_2(x))


class Samba(nn.Module):
    """One SWA block of the hybrid stack (the Mamba layers around it are left out)."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.h = nn.ModuleList([Block(config, 0)])
        self.ln_f = RMSNorm(config.n_embd, eps=config.norm_eps)

    def forward(self, x):
        B, T, _ = x.shape
        cfg = self.config
        n_elem = int(cfg.rotary_percentage * cfg.head_size)
        rope = build_rope_cache(T, n_elem, x.dtype, x.device, base=cfg.rope_base)
        mask = None
        local = self.h[0].attn.local
        if local and cfg.attn_impl in ("eager", "sdpa"):
            mask = local_band_mask(T, cfg.local_window, x.dtype, x.device)
        for block in self.h:
            x = block(x, rope, mask)
        return self.ln_f(x)


def make_samba_swa():
    torch.manual_seed(4202)
    model = Samba(Config())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, RMSNorm):
                mod.weight.uniform_(0.5, 1.5)
            if isinstance(mod, nn.Linear) and mod.bias is not None:
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {
    "target": "make_samba_swa",
    "kind": "causal-multihead",
    "ok": False,
    "layer": "h.0.attn",
    "stage": "rotated_keys",
    "mistake": "rope_missing",
    "style": "Samba SWA (b08_samba_key_rope_inplace_assumed): (base c02) one bug: apply_rope(k[..., "
    ":n_elem], cos, sin) called as if in place (the fused kernel's inplace=True): queries "
    "rotated, keys not",
}

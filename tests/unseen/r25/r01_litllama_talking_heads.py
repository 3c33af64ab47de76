"""lit-llama (Lightning-AI, model.py) CausalSelfAttention inside a one-block LLaMA: fused c_attn split
in three, (B, T, nh, hs) head views, build_rope_cache returning a stacked (cos, sin) table per pair and
apply_rope rotating adjacent pairs (x.reshape(..., -1, 2)), F.scaled_dot_product_attention with the
model's boolean mask_cache slice, c_proj; the block's rms_1/rms_2 RMSNorm (scale) and SwiGLU MLP.

This file: refused (talking heads: attention logits and weights are mixed across heads by learned matrices)."""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class LLaMAConfig:
    block_size: int = 128
    n_layer: int = 1
    n_head: int = 4
    n_embd: int = 64
    rope_base: int = 10000


class RMSNorm(nn.Module):
    def __init__(self, size, dim=-1, eps=1e-5):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.dim = dim

    def forward(self, x):
        norm_x = torch.mean(x * x, dim=self.dim, keepdim=True)
        x_normed = x * torch.rsqrt(norm_x + self.eps)
        return self.scale * x_normed


def build_rope_cache(seq_len, n_elem, dtype, device=None, base=10000):
    theta = 1.0 / (base ** (torch.arange(0, n_elem, 2, dtype=torch.float64, device=device) / n_elem))
    seq_idx = torch.arange(seq_len, dtype=torch.float64, device=device)
    idx_theta = torch.outer(seq_idx, theta)
    cache = torch.stack([torch.cos(idx_theta), torch.sin(idx_theta)], dim=-1)
    return cache.to(dtype)


def apply_rope(x, rope_cache):
    # x: (B, T, n_head, head_size); rope_cache: (>=T, head_size // 2, 2)
    T = x.size(1)
    rope_cache = rope_cache[:T]
    xshaped = x.reshape(*x.shape[:-1], -1, 2)
    rope_cache = rope_cache.view(1, xshaped.size(1), 1, xshaped.size(3), 2)
    x_out2 = torch.stack(
        [
            xshaped[..., 0] * rope_cache[..., 0] - xshaped[..., 1] * rope_cache[..., 1],
            xshaped[..., 1] * rope_cache[..., 0] + xshaped[..., 0] * rope_cache[..., 1],
        ],
        -1,
    )
    return x_out2.flatten(3).type_as(x)


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.block_size = config.block_size
        # talking-heads attention (Shazeer et al. 2020): learned head mixing before and after the softmax
        self.pre_softmax_proj = nn.Parameter(torch.eye(config.n_head) + 0.5 * torch.randn(config.n_head, config.n_head))
        self.post_softmax_proj = nn.Parameter(torch.eye(config.n_head) + 0.5 * torch.randn(config.n_head, config.n_head))

    def forward(self, x, rope, mask):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        head_size = C // self.n_head
        k = k.view(B, T, self.n_head, head_size)
        q = q.view(B, T, self.n_head, head_size)
        v = v.view(B, T, self.n_head, head_size)

        q = apply_rope(q, rope)
        k = apply_rope(k, rope)

        k = k.transpose(1, 2)
        q = q.transpose(1, 2)
        v = v.transpose(1, 2)

        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(head_size))
        att = torch.einsum("bhqk,hg->bgqk", att, self.pre_softmax_proj)
        att = att.masked_fill(~mask, torch.finfo(att.dtype).min)
        att = F.softmax(att, dim=-1)
        att = torch.einsum("bhqk,hg->bgqk", att, self.post_softmax_proj)
        y = att @ v

        y = y.transpose(1, 2).contiguous().view(B, T, C)
        y = self.c_proj(y)
        return y


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        hidden_dim = 2 * config.n_embd
        self.c_fc1 = nn.Linear(config.n_embd, hidden_dim, bias=False)
        self.c_fc2 = nn.Linear(config.n_embd, hidden_dim, bias=False)
        self.c_proj = nn.Linear(hidden_dim, config.n_embd, bias=False)

    def forward(self, x):
        return self.c_proj(F.silu(self.c_fc1(x)) * self.c_fc2(x))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.rms_1 = RMSNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.rms_2 = RMSNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x, rope, mask):
        x = x + self.attn(self.rms_1(x), rope, mask)
        return x + self.mlp(self.rms_2(x))


class LLaMA(nn.Module):
    """Takes token embeddings (B, T, n_embd); the wte/lm_head pair is left out."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]), ln_f=RMSNorm(config.n_embd))
        )
        self.rope_cache = None
        self.mask_cache = None

    def forward(self, x):
        B, T, _ = x.size()
        if self.rope_cache is None or self.rope_cache.dtype != x.dtype:
            self.rope_cache = build_rope_cache(
                self.config.block_size, self.config.n_embd // self.config.n_head, x.dtype, x.device,
                base=self.config.rope_base,
            )
        if self.mask_cache is None:
            ones = torch.ones((self.config.block_size, self.config.block_size), dtype=torch.bool, device=x.device)
            self.mask_cache = torch.tril(ones).unsqueeze(0).unsqueeze(0)
        rope = self.rope_cache[:T]
        mask = self.mask_cache[:, :, :T, :T]
        for block in self.transformer.h:
            x = block(x, rope, mask)
        return self.transformer.ln_f(x)


def make_lit_llama():
    torch.manual_seed(2521)
    model = LLaMA(LLaMAConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, RMSNorm):
                mod.scale.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {
    "target": "make_lit_llama",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "transformer.h.0.attn",
    "unsupported": "talking_heads",
    "style": "lit-llama CausalSelfAttention with talking-heads mixing (pre- and post-softmax head projections)",
}

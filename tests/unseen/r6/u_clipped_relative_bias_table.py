"""GPT-style causal attention with a learned per-head relative position bias table indexed by the clipped
query-key distance (rel_bias[h, clamp(j - i, -max_rel, max_rel) + max_rel], Shaw et al. / Swin-table style in
1D), added after the scale and before the tril mask; SDPA with a float attn_mask carrying bias and mask.
A learned bias table is outside what the checker models: it should refuse, not judge."""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F


class RelBiasCausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.head_dim = config.n_embd // config.n_head
        self.max_rel = config.max_relative_position
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=True)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=True)
        self.relative_position_bias_table = nn.Parameter(
            torch.zeros(config.n_head, 2 * self.max_rel + 1)
        )
        nn.init.trunc_normal_(self.relative_position_bias_table, std=0.5)

    def relative_bias(self, T, device):
        pos = torch.arange(T, device=device)
        rel = (pos[None, :] - pos[:, None]).clamp(
            -self.max_rel, self.max_rel
        ) + self.max_rel  # (T, T)
        return self.relative_position_bias_table[:, rel]  # (n_head, T, T)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_head, self.head_dim).transpose(1, 2)

        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        attn_mask = self.relative_bias(T, x.device).to(q.dtype)
        attn_mask = attn_mask.masked_fill(~causal, float("-inf"))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask.unsqueeze(0))
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = RelBiasCausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(config.n_embd, 4 * config.n_embd),
            nn.GELU(),
            nn.Linear(4 * config.n_embd, config.n_embd),
        )

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def make_block():
    return Block(SimpleNamespace(n_embd=48, n_head=4, max_relative_position=8))


EXPECT = {
    "target": "make_block",
    "kind": "causal-multihead",
    "ok": True,
    "unsupported": "relative_bias",
    "layer": "attn",
    "style": "GPT block with a learned relative_position_bias_table[h, clamp(j - i) + max_rel] (Shaw/Swin-style, 1D) passed with the causal mask as SDPA's float attn_mask",
}

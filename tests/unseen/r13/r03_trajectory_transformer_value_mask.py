"""Trajectory Transformer (jannerm/trajectory-transformer) CausalSelfAttention: minGPT-style
key/query/value Linears, view(B, T, n_head, C // n_head).transpose(1, 2), att = q @ k^T / sqrt(d),
a registered tril mask in which every column holding a value-estimate token (every joined_dim-th
token, index joined_dim - 1, 2 * joined_dim - 1, ...) is zeroed, so no query (itself included) may
attend to the value tokens; masked_fill(-inf), softmax, @ v, proj.

This file: refused (a model-specific column mask on top of the causal mask)."""

import math

import torch
import torch.nn as nn
from torch.nn import functional as F


class Config:
    n_embd = 64
    n_head = 4
    block_size = 128
    observation_dim = 2
    action_dim = 1
    attn_pdrop = 0.0
    resid_pdrop = 0.0


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.key = nn.Linear(config.n_embd, config.n_embd)
        self.query = nn.Linear(config.n_embd, config.n_embd)
        self.value = nn.Linear(config.n_embd, config.n_embd)
        self.attn_drop = nn.Dropout(config.attn_pdrop)
        self.resid_drop = nn.Dropout(config.resid_pdrop)
        self.proj = nn.Linear(config.n_embd, config.n_embd)
        self.register_buffer(
            "mask",
            torch.tril(torch.ones(config.block_size, config.block_size)).view(
                1, 1, config.block_size, config.block_size
            ),
        )
        # mask previous value estimates
        joined_dim = config.observation_dim + config.action_dim + 2
        self.mask.squeeze()[:, joined_dim - 1 :: joined_dim] = 0
        self.n_head = config.n_head

    def forward(self, x):
        B, T, C = x.size()
        k = self.key(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = self.query(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = self.value(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.mask[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.attn_drop(att)
        y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.proj(y))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.n_embd)
        self.ln2 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.mlp = nn.Sequential(
            nn.Linear(config.n_embd, 4 * config.n_embd),
            nn.GELU(),
            nn.Linear(4 * config.n_embd, config.n_embd),
        )

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPTTrunk(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.pos_emb = nn.Parameter(torch.randn(1, config.block_size, config.n_embd) * 0.02)
        self.blocks = nn.Sequential(Block(config))
        self.ln_f = nn.LayerNorm(config.n_embd)

    def forward(self, token_embeddings):
        t = token_embeddings.shape[1]
        x = token_embeddings + self.pos_emb[:, :t, :].to(token_embeddings.dtype)
        return self.ln_f(self.blocks(x))


def make_trajectory_gpt():
    torch.manual_seed(1393)
    model = GPTTrunk(Config())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {
    "target": "make_trajectory_gpt",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "blocks.0.attn",
    "unsupported": "custom_mask_pattern",
    "style": "Trajectory Transformer CausalSelfAttention: tril mask with every joined_dim-th column (the value "
    "tokens) zeroed, so no query attends to a value token, its own included",
}

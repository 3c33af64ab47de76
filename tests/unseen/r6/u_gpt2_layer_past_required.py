"""GPT-2 style causal self-attention for cached decoding (c_attn split q/k/v, tril `bias` buffer sliced
at the cached length, returns (y, present)) whose forward takes layer_past=(past_key, past_value) as a
required argument (empty tensors for a fresh prompt).  The past keys/values are an input the checker cannot
make up: it should refuse, not judge."""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F


@dataclass
class GPTConfig:
    block_size: int = 128
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    bias: bool = True


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig = GPTConfig()):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.register_buffer(
            "bias",
            torch.tril(torch.ones(config.block_size, config.block_size)).view(
                1, 1, config.block_size, config.block_size
            ),
        )

    def empty_past(self, batch_size: int, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        hs = self.n_embd // self.n_head
        shape = (batch_size, self.n_head, 0, hs)
        return torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)

    def forward(self, x: torch.Tensor, layer_past: tuple[torch.Tensor, torch.Tensor]):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)

        past_key, past_value = layer_past
        T_past = past_key.size(-2)
        k = torch.cat((past_key, k), dim=-2)
        v = torch.cat((past_value, v), dim=-2)
        present = (k, v)

        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(
            self.bias[:, :, T_past : T_past + T, : T_past + T] == 0, float("-inf")
        )
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        y = self.resid_dropout(self.c_proj(y))
        return y, present


EXPECT = {
    "target": "CausalSelfAttention",
    "kind": "causal-multihead",
    "ok": True,
    "unsupported": "kv_cache",
    "style": "GPT-2/nanoGPT CausalSelfAttention for cached decoding: forward(x, layer_past) with past keys/values required, returns (y, present)",
}

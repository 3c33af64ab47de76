"""A nanoGPT fork with a KV cache in the Hugging Face GPT-2 manner: each block takes a
layer_past tuple (k, v) shaped (B, n_head, T, head_size) and returns its present;
forward(idx, past_key_values=None, use_cache=False) returns an output with .logits and
.past_key_values (a tuple of per-layer (k, v)); positions start at the cached length.
SDPA with is_causal only when more than one query is fed.  Four blocks, eight heads.

Slip: the cache is concatenated along the last axis (head_size) instead of the sequence axis
(-2), torch.cat((past_key, k), dim=-1).  The prompt pass (no past) is right; the first one-token
step raises in the first block ("Sizes of tensors must match except in dimension 3").
The full forward is right.
"""

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": [
        "transformer.h.0.attn",
        "transformer.h.1.attn",
        "transformer.h.2.attn",
        "transformer.h.3.attn",
    ],
    "kind": "causal-multihead",
    "cache": "hf",
    "decode": {"mistake": "cache_other", "step": 0, "layer": "transformer.h.0.attn"},
    "style": "nanoGPT + HF GPT-2 style layer_past/presents tuples; slip: torch.cat(..., dim=-1) on the "
    "cache (head_size axis), so the first decoding step raises",
}


@dataclass
class GPTConfig:
    block_size: int = 96
    vocab_size: int = 58
    n_layer: int = 4
    n_head: int = 8
    n_embd: int = 64


@dataclass
class CausalLMOutputWithPast:
    logits: torch.Tensor
    past_key_values: Optional[Tuple[Tuple[torch.Tensor, torch.Tensor], ...]] = None


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)

    def forward(self, x, layer_past=None, use_cache=False):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if layer_past is not None:
            past_key, past_value = layer_past
            k = torch.cat((past_key, k), dim=-1)
            v = torch.cat((past_value, v), dim=-1)
        present = (k, v) if use_cache else None
        y = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y), present


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(config.n_embd, 4 * config.n_embd),
            nn.GELU(),
            nn.Linear(4 * config.n_embd, config.n_embd),
        )

    def forward(self, x, layer_past=None, use_cache=False):
        a, present = self.attn(self.ln_1(x), layer_past=layer_past, use_cache=use_cache)
        x = x + a
        return x + self.mlp(self.ln_2(x)), present


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, idx, past_key_values=None, use_cache=False):
        B, T = idx.size()
        if past_key_values is None:
            past_length = 0
            past_key_values = tuple([None] * self.config.n_layer)
        else:
            past_length = past_key_values[0][0].size(-2)
        pos = torch.arange(past_length, past_length + T, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        presents = () if use_cache else None
        for block, layer_past in zip(self.transformer.h, past_key_values):
            x, present = block(x, layer_past=layer_past, use_cache=use_cache)
            if use_cache:
                presents = presents + (present,)
        x = self.transformer.ln_f(x)
        return CausalLMOutputWithPast(logits=self.lm_head(x), past_key_values=presents)


def make_model():
    torch.manual_seed(21)
    model = GPT(GPTConfig())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn_like(m.weight))
                m.bias.copy_(0.1 * torch.randn_like(m.bias))
    return model.eval()

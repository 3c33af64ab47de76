"""A tiny Llama in the style of Lightning AI's lit-gpt / litgpt (litgpt/model.py).

GPT -> transformer ModuleDict(wte, h ModuleList of Block(norm_1, attn, norm_2, mlp), ln_f)
+ lm_head.  CausalSelfAttention with one fused `attn` Linear split into q, k, v by size
(n_head*hs, n_query_groups*hs, n_query_groups*hs), GQA 4/2 by expand to (B, groups,
q_per_kv, T, hs), rope on the first rope_n_elem dims (rotary_percentage 1.0, rotate-half
style apply_rope), cos/sin and the mask picked with index_select(input_pos) from
model-level caches, SDPA with the explicit boolean mask when one is given.

The KV cache is external (book-cache): KVCache(n_layers) holds one static
(B, groups, 64, hs) buffer per layer, allocated on first use, and the model writes new keys
and values at input_pos.  Calling: cache = KVCache(n_layers=3); model.reset_kv_cache();
model(prompt, cache=cache); model(tok, cache=cache).

Slip: KVCache.update uses `index_copy` (out of place) where litgpt uses `index_copy_`.  The
returned tensors hold the new keys, so each call's own attention is right, but nothing is
ever stored.  The first one-token step sees zero keys/values for the whole prompt.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["transformer.h.0.attn", "transformer.h.1.attn", "transformer.h.2.attn"],
    "kind": "causal-multihead",
    "cache": "book-cache",
    "decode": {"mistake": "cache_stale", "step": 0, "layer": "transformer.h.0.attn"},
    "style": "litgpt model.py: fused attn split by size, build_rope_cache/index_select(input_pos), mask_cache, "
    "static KV buffers; slip: index_copy instead of index_copy_, so the cache is never written",
}


@dataclass
class Config:
    block_size: int = 64
    vocab_size: int = 128
    n_layer: int = 3
    n_head: int = 4
    n_query_groups: int = 2
    n_embd: int = 64
    rotary_percentage: float = 1.0
    rope_base: int = 10000
    intermediate_size: int = 128
    norm_eps: float = 1e-5

    @property
    def head_size(self):
        return self.n_embd // self.n_head

    @property
    def rope_n_elem(self):
        return int(self.rotary_percentage * self.head_size)


class RMSNorm(nn.Module):
    def __init__(self, size, dim=-1, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.dim = dim

    def forward(self, x):
        dtype = x.dtype
        norm_x = torch.mean(x * x, dim=self.dim, keepdim=True)
        x_normed = x * torch.rsqrt(norm_x + self.eps)
        return (x_normed * self.weight).to(dtype=dtype)


def build_rope_cache(seq_len, n_elem, base=10000):
    theta = 1.0 / (base ** (torch.arange(0, n_elem, 2).float() / n_elem))
    seq_idx = torch.arange(seq_len).float()
    idx_theta = torch.outer(seq_idx, theta).repeat(1, 2)
    return torch.cos(idx_theta), torch.sin(idx_theta)


def apply_rope(x, cos, sin):
    head_size = x.size(-1)
    x1 = x[..., : head_size // 2]
    x2 = x[..., head_size // 2 :]
    rotated = torch.cat((-x2, x1), dim=-1)
    roped = (x * cos) + (rotated * sin)
    return roped.to(dtype=x.dtype)


class KVCache:
    """Book-cache object: one static buffer pair per layer, written at input_pos."""

    def __init__(self, n_layers, max_seq_length=64):
        self.n_layers = n_layers
        self.max_seq_length = max_seq_length
        self.k = [None] * n_layers
        self.v = [None] * n_layers
        self.pos = 0

    def reset(self):
        self.k = [None] * self.n_layers
        self.v = [None] * self.n_layers
        self.pos = 0

    def update(self, layer_idx, input_pos, k, v):
        if self.k[layer_idx] is None:
            B, G, _, hs = k.shape
            self.k[layer_idx] = torch.zeros(
                B, G, self.max_seq_length, hs, dtype=k.dtype, device=k.device
            )
            self.v[layer_idx] = torch.zeros(
                B, G, self.max_seq_length, hs, dtype=v.dtype, device=v.device
            )
        self.k[layer_idx] = self.k[layer_idx].to(k.dtype)
        self.v[layer_idx] = self.v[layer_idx].to(v.dtype)
        k = self.k[layer_idx].index_copy(2, input_pos, k.detach())
        v = self.v[layer_idx].index_copy(2, input_pos, v.detach())
        return k, v


class CausalSelfAttention(nn.Module):
    def __init__(self, config, block_idx):
        super().__init__()
        shape = (config.n_head + 2 * config.n_query_groups) * config.head_size
        self.attn = nn.Linear(config.n_embd, shape, bias=False)
        self.proj = nn.Linear(config.head_size * config.n_head, config.n_embd, bias=False)
        self.config = config
        self.block_idx = block_idx

    def forward(self, x, cos, sin, mask=None, input_pos=None, kv_cache=None):
        B, T, C = x.size()
        cfg = self.config
        head_size = cfg.head_size
        n_head = cfg.n_head
        n_query_groups = cfg.n_query_groups
        q_per_kv = n_head // n_query_groups

        qkv = self.attn(x)
        query_size = n_head * head_size
        key_size = value_size = n_query_groups * head_size
        q, k, v = qkv.split((query_size, key_size, value_size), dim=-1)
        q = q.view(B, T, n_head, head_size).transpose(1, 2)
        k = k.view(B, T, n_query_groups, head_size).transpose(1, 2)
        v = v.view(B, T, n_query_groups, head_size).transpose(1, 2)

        rope_n_elem = cfg.rope_n_elem
        q_roped = apply_rope(q[..., :rope_n_elem], cos, sin)
        k_roped = apply_rope(k[..., :rope_n_elem], cos, sin)
        q = torch.cat((q_roped, q[..., rope_n_elem:]), dim=-1)
        k = torch.cat((k_roped, k[..., rope_n_elem:]), dim=-1)

        if input_pos is not None and kv_cache is not None:
            k, v = kv_cache.update(self.block_idx, input_pos, k, v)

        if n_query_groups != n_head:
            k = k[:, :, None].expand(-1, -1, q_per_kv, -1, -1).reshape(B, n_head, -1, head_size)
            v = v[:, :, None].expand(-1, -1, q_per_kv, -1, -1).reshape(B, n_head, -1, head_size)

        scale = 1.0 / math.sqrt(head_size)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=0.0, scale=scale, is_causal=mask is None
        )
        y = y.transpose(1, 2).reshape(B, T, head_size * n_head)
        return self.proj(y)


class LLaMAMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.fc_1 = nn.Linear(config.n_embd, config.intermediate_size, bias=False)
        self.fc_2 = nn.Linear(config.n_embd, config.intermediate_size, bias=False)
        self.proj = nn.Linear(config.intermediate_size, config.n_embd, bias=False)

    def forward(self, x):
        return self.proj(F.silu(self.fc_1(x)) * self.fc_2(x))


class Block(nn.Module):
    def __init__(self, config, block_idx):
        super().__init__()
        self.norm_1 = RMSNorm(config.n_embd, eps=config.norm_eps)
        self.attn = CausalSelfAttention(config, block_idx)
        self.norm_2 = RMSNorm(config.n_embd, eps=config.norm_eps)
        self.mlp = LLaMAMLP(config)

    def forward(self, x, cos, sin, mask=None, input_pos=None, kv_cache=None):
        x = self.attn(self.norm_1(x), cos, sin, mask, input_pos, kv_cache) + x
        return self.mlp(self.norm_2(x)) + x


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                h=nn.ModuleList(Block(config, i) for i in range(config.n_layer)),
                ln_f=RMSNorm(config.n_embd, eps=config.norm_eps),
            )
        )
        self.max_seq_length = config.block_size
        cos, sin = build_rope_cache(self.max_seq_length, config.rope_n_elem, config.rope_base)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        ones = torch.ones((self.max_seq_length, self.max_seq_length), dtype=torch.bool)
        self.register_buffer(
            "mask_cache", torch.tril(ones).unsqueeze(0).unsqueeze(0), persistent=False
        )

    def reset_kv_cache(self):
        """The cache object is external; nothing lives in the model."""
        return None

    def forward(self, idx, input_pos=None, cache=None):
        T = idx.size(1)
        if cache is not None and input_pos is None:
            input_pos = torch.arange(cache.pos, cache.pos + T)
        if input_pos is not None:
            cos = self.cos.index_select(0, input_pos)
            sin = self.sin.index_select(0, input_pos)
            mask = self.mask_cache.index_select(2, input_pos)
        else:
            cos = self.cos[:T]
            sin = self.sin[:T]
            mask = None
        x = self.transformer.wte(idx)
        for block in self.transformer.h:
            x = block(x, cos, sin, mask, input_pos, cache)
        x = self.transformer.ln_f(x)
        if cache is not None:
            cache.pos += T
        return self.lm_head(x)


def make_model():
    torch.manual_seed(1414)
    model = GPT(Config())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn_like(m.weight))
    return model.eval()

"""The language half of huggingface/nanoVLM (models/language_model.py), used on its own as a causal LM.

LanguageModel: token_embedding, rotary_embd (RotaryEmbedding: inv_freq, base 1e5, rotate_half /
halves pairing), blocks.N (LanguageModelBlock: norm1 -> attn -> + residual, norm2 -> mlp -> + residual),
norm, head.  LanguageModelGroupedQueryAttention: q_proj/k_proj/v_proj/out_proj without bias,
GQA 6/3 with repeat_interleave on the head axis (query head h reads kv head h // 2), per-block kv
cache as a dict {'key', 'value'} in (b, kv_heads, s, d) concatenated on dim 2, SDPA with is_causal on
the prompt and a boolean mask on cached steps.  Positions come from a `start_pos` the model reads from
the cache.
Cache: book-cache: `cache = mod.KVCache(n_layers=3)`, `model.reset_kv_cache()`, then
`model(prompt, cache=cache)` and `model(tok, cache=cache)`.  Returns a logits tensor.
Correct.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from types import SimpleNamespace

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": ["blocks.0.attn", "blocks.1.attn", "blocks.2.attn"],
    "kind": "causal-multihead",
    "cache": "book-cache",
    "style": "nanoVLM language_model.py: token_embedding/rotary_embd/blocks/norm/head, norm1/attn/norm2/mlp blocks, "
    "GQA 6/3 repeat_interleave, rotate_half base 1e5, per-block {'key','value'} dict caches held by an external "
    "KVCache passed as cache=",
}


class KVCache:
    def __init__(self, n_layers):
        self.cache = [None] * n_layers
        self.n_layers = n_layers

    def get(self, layer_idx):
        return self.cache[layer_idx]

    def update(self, layer_idx, value):
        self.cache[layer_idx] = value

    def reset(self):
        self.cache = [None] * self.n_layers


class RMSNorm(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(cfg.lm_hidden_dim))
        self.eps = cfg.lm_rms_eps

    def forward(self, x):
        irms = torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + self.eps)
        return x * irms * self.weight


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.dim = cfg.lm_hidden_dim // cfg.lm_n_heads
        self.base = cfg.lm_re_base
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2, dtype=torch.float64) / self.dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, position_ids):
        freqs = position_ids.to(self.inv_freq.dtype)[:, :, None] * self.inv_freq[None, None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return torch.cos(emb), torch.sin(emb)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_embd(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1).to(q.dtype), sin.unsqueeze(1).to(q.dtype)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class LanguageModelGroupedQueryAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_heads = cfg.lm_n_heads
        self.n_kv_heads = cfg.lm_n_kv_heads
        self.embd_dim = cfg.lm_hidden_dim
        self.head_dim = self.embd_dim // self.n_heads
        self.n_kv_groups = self.n_heads // self.n_kv_heads
        self.q_proj = nn.Linear(self.embd_dim, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(self.embd_dim, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(self.embd_dim, self.n_kv_heads * self.head_dim, bias=False)
        self.out_proj = nn.Linear(self.n_heads * self.head_dim, self.embd_dim, bias=False)

    def forward(self, x, cos, sin, block_kv_cache=None):
        B, T_curr, C = x.size()
        q = self.q_proj(x).view(B, T_curr, self.n_heads, self.head_dim).transpose(1, 2)
        k_curr = self.k_proj(x).view(B, T_curr, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v_curr = self.v_proj(x).view(B, T_curr, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k_rot = apply_rotary_pos_embd(q, k_curr, cos, sin)
        if block_kv_cache is not None:
            k = torch.cat([block_kv_cache["key"], k_rot], dim=-2)
            v = torch.cat([block_kv_cache["value"], v_curr], dim=-2)
        else:
            k, v = k_rot, v_curr
        block_kv_cache = {"key": k, "value": v}
        k_exp = k.repeat_interleave(self.n_kv_groups, dim=1)
        v_exp = v.repeat_interleave(self.n_kv_groups, dim=1)
        T_kv = k_exp.size(2)
        if T_kv == T_curr:
            y = F.scaled_dot_product_attention(q, k_exp, v_exp, is_causal=True)
        else:
            past = T_kv - T_curr
            allowed = torch.arange(T_kv, device=x.device)[None, :] <= (past + torch.arange(T_curr, device=x.device))[:, None]
            y = F.scaled_dot_product_attention(q, k_exp, v_exp, attn_mask=allowed[None, None])
        y = y.transpose(1, 2).contiguous().view(B, T_curr, C)
        return self.out_proj(y), block_kv_cache


class LanguageModelMLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.lm_hidden_dim, cfg.lm_inter_dim, bias=False)
        self.up_proj = nn.Linear(cfg.lm_hidden_dim, cfg.lm_inter_dim, bias=False)
        self.down_proj = nn.Linear(cfg.lm_inter_dim, cfg.lm_hidden_dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LanguageModelBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.mlp = LanguageModelMLP(cfg)
        self.attn = LanguageModelGroupedQueryAttention(cfg)
        self.norm1 = RMSNorm(cfg)
        self.norm2 = RMSNorm(cfg)

    def forward(self, x, cos, sin, block_kv_cache=None):
        res = x
        x, block_kv_cache = self.attn(self.norm1(x), cos, sin, block_kv_cache)
        x = res + x
        x = x + self.mlp(self.norm2(x))
        return x, block_kv_cache


class LanguageModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.token_embedding = nn.Embedding(cfg.lm_vocab_size, cfg.lm_hidden_dim)
        self.rotary_embd = RotaryEmbedding(cfg)
        self.blocks = nn.ModuleList([LanguageModelBlock(cfg) for _ in range(cfg.lm_n_blocks)])
        self.norm = RMSNorm(cfg)
        self.head = nn.Linear(cfg.lm_hidden_dim, cfg.lm_vocab_size, bias=False)
        self.current_pos = 0

    def reset_kv_cache(self):
        self.current_pos = 0

    def forward(self, x, cache=None):
        x = self.token_embedding(x)
        B, T_curr, _ = x.size()
        start_pos = 0
        if cache is not None and cache.get(0) is not None:
            start_pos = cache.get(0)["key"].size(-2)
        current_position_ids = torch.arange(start_pos, start_pos + T_curr, device=x.device).unsqueeze(0).expand(B, -1)
        cos, sin = self.rotary_embd(current_position_ids)
        for i, block in enumerate(self.blocks):
            x, block_cache = block(x, cos, sin, cache.get(i) if cache is not None else None)
            if cache is not None:
                cache.update(i, block_cache)
        if cache is not None:
            self.current_pos = start_pos + T_curr
        return self.head(self.norm(x))


def make_model():
    torch.manual_seed(0)
    cfg = SimpleNamespace(lm_hidden_dim=96, lm_inter_dim=192, lm_rms_eps=1e-5, lm_re_base=100000.0,
                          lm_vocab_size=128, lm_n_heads=6, lm_n_kv_heads=3, lm_n_blocks=3)
    model = LanguageModel(cfg)
    for m in model.modules():
        if isinstance(m, RMSNorm):
            nn.init.uniform_(m.weight, 0.6, 1.4)
    return model.eval()

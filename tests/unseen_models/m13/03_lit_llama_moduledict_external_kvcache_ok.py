"""Lightning-AI lit-llama model.py (pre-litgpt), reduced, with an external key/value cache object.

LLaMA: `transformer` = ModuleDict(wte, h = ModuleList of Block, ln_f) and lm_head.  Block: rms_1 ->
attn -> + x -> rms_2 -> mlp (c_fc1, c_fc2, c_proj SwiGLU) -> + x.  CausalSelfAttention: fused `c_attn`
split(n_embd) into q, k, v, `c_proj`, 4 heads of 16 (MHA), `rope_cache` as a (T, hd/2, 2) cos/sin table
applied by apply_rope to adjacent pairs (base 1e4), masked_fill of a boolean tril mask with -inf,
explicit softmax.
Cache: book-cache.  `cache = mod.KVCache(n_layers=3)` (`get(i)`, `update(i, (k, v))`, `seq_len()`),
`model(prompt, cache=cache)`, `model(tok, cache=cache)`; entries (b, h, s, d) grown on dim 2.
`model.reset_kv_cache()` is a no-op.  Returns logits.  Correct.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": ["transformer.h.0.attn", "transformer.h.1.attn", "transformer.h.2.attn"],
    "kind": "causal-multihead",
    "cache": "book-cache",
    "style": "lit-llama model.py: transformer ModuleDict(wte, h, ln_f), fused c_attn split by n_embd, rope_cache "
    "pairs (apply_rope), masked_fill -inf + softmax, external KVCache passed as cache=",
}


class KVCache:
    def __init__(self, n_layers):
        self.entries = [None] * n_layers

    def get(self, i):
        return self.entries[i]

    def update(self, i, kv):
        self.entries[i] = kv

    def seq_len(self):
        return 0 if self.entries[0] is None else self.entries[0][0].shape[2]

    def reset(self):
        self.entries = [None] * len(self.entries)


class RMSNorm(nn.Module):
    def __init__(self, size, dim=-1, eps=1e-5):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(size))
        self.eps, self.dim = eps, dim

    def forward(self, x):
        norm_x = torch.mean(x * x, dim=self.dim, keepdim=True)
        return self.scale * (x * torch.rsqrt(norm_x + self.eps))


def build_rope_cache(seq_len, n_elem, base=10000):
    theta = 1.0 / (base ** (torch.arange(0, n_elem, 2, dtype=torch.float64) / n_elem))
    idx_theta = torch.outer(torch.arange(seq_len, dtype=torch.float64), theta)
    return torch.stack([torch.cos(idx_theta), torch.sin(idx_theta)], dim=-1)


def apply_rope(x, rope_cache):
    # x: (B, T, nh, hs)
    T = x.size(1)
    rope_cache = rope_cache[:T].to(x.dtype)
    xshaped = x.reshape(*x.shape[:-1], -1, 2)
    rope_cache = rope_cache.view(1, T, 1, xshaped.size(3), 2)
    x_out2 = torch.stack([
        xshaped[..., 0] * rope_cache[..., 0] - xshaped[..., 1] * rope_cache[..., 1],
        xshaped[..., 1] * rope_cache[..., 0] + xshaped[..., 0] * rope_cache[..., 1],
    ], -1)
    return x_out2.flatten(3)


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=False)
        self.n_head, self.n_embd = n_head, n_embd

    def forward(self, x, rope, mask, layer_cache=None):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        hs = C // self.n_head
        k = k.view(B, T, self.n_head, hs)
        q = q.view(B, T, self.n_head, hs)
        v = v.view(B, T, self.n_head, hs)
        q = apply_rope(q, rope)
        k = apply_rope(k, rope)
        k, q, v = k.transpose(1, 2), q.transpose(1, 2), v.transpose(1, 2)
        if layer_cache is not None:
            past = layer_cache
            if past is not None:
                k = torch.cat([past[0], k], dim=2)
                v = torch.cat([past[1], v], dim=2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
        att = att.masked_fill(~mask, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y), (k, v)


class MLP(nn.Module):
    def __init__(self, n_embd):
        super().__init__()
        hidden = 176
        self.c_fc1 = nn.Linear(n_embd, hidden, bias=False)
        self.c_fc2 = nn.Linear(n_embd, hidden, bias=False)
        self.c_proj = nn.Linear(hidden, n_embd, bias=False)

    def forward(self, x):
        return self.c_proj(F.silu(self.c_fc1(x)) * self.c_fc2(x))


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.rms_1 = RMSNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.rms_2 = RMSNorm(n_embd)
        self.mlp = MLP(n_embd)

    def forward(self, x, rope, mask, layer_cache=None):
        h, new_kv = self.attn(self.rms_1(x), rope, mask, layer_cache)
        x = x + h
        return x + self.mlp(self.rms_2(x)), new_kv


class LLaMA(nn.Module):
    def __init__(self, vocab_size=100, n_layer=3, n_head=4, n_embd=64, block_size=64):
        super().__init__()
        self.block_size = block_size
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd),
            h=nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer)),
            ln_f=RMSNorm(n_embd),
        ))
        self.n_head, self.n_embd = n_head, n_embd

    def reset_kv_cache(self):
        pass

    def forward(self, idx, cache=None):
        B, T = idx.size()
        past = cache.seq_len() if cache is not None else 0
        rope = build_rope_cache(self.block_size, self.n_embd // self.n_head)[past: past + T]
        total = past + T
        mask = torch.ones(total, total, dtype=torch.bool, device=idx.device).tril()[past:total].view(1, 1, T, total)
        x = self.transformer.wte(idx)
        for i, block in enumerate(self.transformer.h):
            layer_cache = cache.get(i) if cache is not None else None
            x, new_kv = block(x, rope, mask, layer_cache)
            if cache is not None:
                cache.update(i, new_kv)
        return self.lm_head(self.transformer.ln_f(x))


def make_model():
    torch.manual_seed(1303)
    model = LLaMA()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.scale.copy_(1.0 + 0.2 * torch.randn_like(m.scale))
    return model.eval()

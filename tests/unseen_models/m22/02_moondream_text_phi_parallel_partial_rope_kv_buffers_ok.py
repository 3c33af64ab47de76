"""vikhyat/moondream text model (moondream/torch/text.py, the phi-1.5 derived decoder) in plain torch.

The text tower is kept as moondream builds it: `text.wte` (a bare embedding parameter), `text.blocks.N`
with `ln` (LayerNorm with bias), `attn` (fused `qkv` Linear with bias and `proj`), `mlp` (`fc1`/`fc2`,
gelu tanh), `text.post_ln`, `text.lm_head`.  Blocks are phi's parallel form: one LayerNorm feeds both
the attention and the MLP, and both are added to the residual.  Rotary is partial: only the first
`rot_dim` = 8 of 16 features of every head are rotated (halves pairing, theta 1e4), the rest pass.
Each block owns a `kv_cache` module with `k_cache`/`v_cache` buffers (batch <= 4, 64 positions, in
(b, heads, ctx, d)); `update(pos_ids, k, v)` writes the new slots and returns the whole buffer, and the
attention masks every key whose position is later than the query's (unwritten slots included).
Cache: book-buffers: `model.reset_kv_cache()`, `model(prompt, use_cache=True)`,
`model(tok, use_cache=True)`; `model(ids)` runs without touching the buffers.  Returns logits.
Correct.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": ["text.blocks.0.attn", "text.blocks.1.attn", "text.blocks.2.attn", "text.blocks.3.attn"],
    "kind": "causal-multihead",
    "cache": "book-buffers",
    "style": "moondream torch text.py: wte parameter, blocks.N ln/attn(qkv, proj)/mlp(fc1, fc2), phi parallel "
    "residual, partial rotary 8 of 16 (halves, 1e4), per-block KVCache buffers updated at pos_ids, "
    "bool mask over the whole buffer",
}

MAX_BATCH = 4
MAX_CONTEXT = 64


def precompute_freqs_cis(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64)[: dim // 2] / dim))
    t = torch.arange(end, dtype=torch.float64)
    freqs = torch.outer(t, freqs)
    return torch.stack([torch.cos(freqs), torch.sin(freqs)], dim=-1)  # (end, dim/2, 2), float64


def apply_rotary_emb(x, freqs_cis, position_ids, rot_dim):
    # x: (b, h, s, head_dim); rotate the first rot_dim features, halves pairing
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    d = rot_dim // 2
    xq_r, xq_i = x_rot[..., :d], x_rot[..., d:]
    fc = freqs_cis[position_ids].to(x.dtype)  # (s, d, 2)
    cos, sin = fc[..., 0], fc[..., 1]
    out_r = xq_r * cos - xq_i * sin
    out_i = xq_r * sin + xq_i * cos
    return torch.cat([out_r, out_i, x_pass], dim=-1)


class KVCache(nn.Module):
    def __init__(self, n_heads, head_dim):
        super().__init__()
        shape = (MAX_BATCH, n_heads, MAX_CONTEXT, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape), persistent=False)

    def reset(self):
        self.k_cache.zero_()
        self.v_cache.zero_()

    def update(self, pos_ids, k, v):
        b = k.shape[0]
        self.k_cache[:b, :, pos_ids, :] = k
        self.v_cache[:b, :, pos_ids, :] = v
        return self.k_cache[:b], self.v_cache[:b]


class TextAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_heads = config.n_heads
        self.head_dim = config.dim // config.n_heads
        self.rot_dim = config.rot_dim
        self.qkv = nn.Linear(config.dim, 3 * config.dim)
        self.proj = nn.Linear(config.dim, config.dim)

    def forward(self, x, freqs_cis, attn_mask, pos_ids, kv_cache=None):
        bsz, q_len, d_model = x.shape
        qkv_out = self.qkv(x)
        q, k, v = [
            t.view(bsz, q_len, self.n_heads, self.head_dim).transpose(1, 2)
            for t in qkv_out.chunk(3, dim=-1)
        ]
        q = apply_rotary_emb(q, freqs_cis, pos_ids, self.rot_dim)
        k = apply_rotary_emb(k, freqs_cis, pos_ids, self.rot_dim)
        if kv_cache is not None:
            k, v = kv_cache.update(pos_ids, k, v)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(~attn_mask, float("-inf"))
        out = F.softmax(scores, dim=-1) @ v
        out = out.transpose(1, 2).reshape(bsz, q_len, d_model)
        return self.proj(out)


class MLP(nn.Module):
    def __init__(self, dim, ff_dim):
        super().__init__()
        self.fc1 = nn.Linear(dim, ff_dim)
        self.fc2 = nn.Linear(ff_dim, dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln = nn.LayerNorm(config.dim)
        self.attn = TextAttention(config)
        self.mlp = MLP(config.dim, config.ff_dim)
        self.kv_cache = KVCache(config.n_heads, config.dim // config.n_heads)

    def forward(self, x, freqs_cis, attn_mask, pos_ids, use_cache):
        l_in = self.ln(x)
        l_attn = self.attn(l_in, freqs_cis, attn_mask, pos_ids, self.kv_cache if use_cache else None)
        l_mlp = self.mlp(l_in)
        return x + l_attn + l_mlp


class TextModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Parameter(torch.randn(config.vocab_size, config.dim) * 0.5)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layers)])
        self.post_ln = nn.LayerNorm(config.dim)
        self.lm_head = nn.Linear(config.dim, config.vocab_size)


class MoondreamTextLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.text = TextModel(config)
        self.pos = 0

    def reset_kv_cache(self):
        self.pos = 0
        for block in self.text.blocks:
            block.kv_cache.reset()

    def forward(self, input_ids, use_cache=False):
        bsz, q_len = input_ids.shape
        start = self.pos if use_cache else 0
        x = F.embedding(input_ids, self.text.wte)
        pos_ids = torch.arange(start, start + q_len, device=input_ids.device)
        freqs_cis = precompute_freqs_cis(self.config.rot_dim, MAX_CONTEXT)
        if use_cache:
            for block in self.text.blocks:
                if block.kv_cache.k_cache.dtype != x.dtype:
                    block.kv_cache.k_cache = block.kv_cache.k_cache.to(x.dtype)
                    block.kv_cache.v_cache = block.kv_cache.v_cache.to(x.dtype)
            key_pos = torch.arange(MAX_CONTEXT, device=input_ids.device)
        else:
            key_pos = pos_ids
        attn_mask = (key_pos[None, :] <= pos_ids[:, None])[None, None]
        for block in self.text.blocks:
            x = block(x, freqs_cis, attn_mask, pos_ids, use_cache)
        if use_cache:
            self.pos = start + q_len
        return self.text.lm_head(self.text.post_ln(x))


def make_model():
    torch.manual_seed(2202)
    config = SimpleNamespace(vocab_size=96, dim=64, ff_dim=256, n_layers=4, n_heads=4, rot_dim=8)
    model = MoondreamTextLM(config)
    g = torch.Generator().manual_seed(22021)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model.eval()

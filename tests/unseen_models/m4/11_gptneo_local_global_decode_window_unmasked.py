"""GPT-Neo in nanoGPT clothing (written from memory of modeling_gpt_neo.py): attention_types
alternate global/local, local layers (odd: h.1, h.3) see a window of window_size = 4 keys (the
query included), learned absolute positions, fused c_attn, 4 layers, 4 heads of 16.  Unlike the
original GPT-Neo, scores ARE scaled by 1/sqrt(head_dim) (GPT-Neo leaves them unscaled by design).
The window is declared as config.window_size and on each attention as `window_size` (None on global layers).

Cache (book-buffers): model.reset_kv_cache(); model(prompt, use_cache=True); model(tok, use_cache=True).
Each attention grows cache_k/cache_v by torch.cat; model.current_pos gives the start position.  A plain call uses no cache.

Slip (decoding only): the mask is skipped for one-token calls ("a single new token never sees the
future"), which forgets the sliding window: the local layers' decoded token sees every cached key.
With a prompt of P >= 4 tokens this diverges at step 0 in transformer.h.1.attn (prompt 5: sees 6
keys instead of 4); with shorter prompts at the first step whose position reaches 4 (step 4 - P).
Decode step 0 (for prompts of 4+), transformer.h.1.attn: cache_mask.
"""

import math

import torch
import torch.nn as nn

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
    "cache": "book-buffers",
    "decode": {"mistake": "cache_mask", "step": 0, "layer": "transformer.h.1.attn"},
    "style": "GPT-Neo local/global (window 4) with buffers; slip: no mask on one-token steps, local window lost",
}

SLIP = "no_mask_single_token"


class Config:
    vocab_size = 150
    n_embd = 64
    n_layer = 4
    n_head = 4
    block_size = 64
    alibi = False
    attention_types = ["global", "local"]
    window_size = 4


def alibi_slopes(n_head):
    # standard geometric sequence for a power-of-two head count: 2^(-8/n), 2^(-16/n), ...
    start = 2.0 ** (-8.0 / n_head)
    return torch.tensor([start ** (h + 1) for h in range(n_head)])


class SelfAttention(nn.Module):
    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.n_head = cfg.n_head
        self.n_embd = cfg.n_embd
        self.head_dim = cfg.n_embd // cfg.n_head
        self.layer_idx = layer_idx
        self.attention_type = cfg.attention_types[layer_idx % len(cfg.attention_types)]
        self.window_size = cfg.window_size if self.attention_type == "local" else None
        self.use_alibi = cfg.alibi
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        n_slopes = (
            2 * cfg.n_head if (SLIP == "slopes_for_twice_heads" and layer_idx == 2) else cfg.n_head
        )
        self.register_buffer("slopes", alibi_slopes(n_slopes)[: cfg.n_head], persistent=False)
        self.cache_k = None
        self.cache_v = None

    def reset_cache(self):
        self.cache_k = None
        self.cache_v = None

    def forward(self, x, start_pos, use_cache):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        if use_cache:
            if self.cache_k is not None:
                k = torch.cat((self.cache_k, k), dim=2)
                v = torch.cat((self.cache_v, v), dim=2)
            self.cache_k, self.cache_v = k, v
        S = k.shape[2]
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        q_pos = torch.arange(start_pos, start_pos + T, device=x.device)
        k_pos = torch.arange(S, device=x.device)
        rel = q_pos[:, None] - k_pos[None, :]
        if self.use_alibi:
            att = att - self.slopes.view(1, -1, 1, 1).to(att.dtype) * rel.to(att.dtype)
        hidden = rel < 0
        window = self.window_size
        if SLIP == "window_ignored" and self.layer_idx == 1:
            window = None
        if window is not None:
            hidden = hidden | (rel >= window)
        if not (SLIP == "no_mask_single_token" and T == 1):
            att = att.masked_fill(hidden, float("-inf"))
        att = torch.softmax(att, dim=-1)
        y = att @ v
        if SLIP == "merge_without_transpose" and self.layer_idx == 1:
            y = y.reshape(B, T, C)
        else:
            y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, cfg, i):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = SelfAttention(cfg, i)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x, start_pos, use_cache):
        x = x + self.attn(self.ln_1(x), start_pos, use_cache)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        modules = dict(wte=nn.Embedding(cfg.vocab_size, cfg.n_embd))
        if not cfg.alibi:
            modules["wpe"] = nn.Embedding(cfg.block_size, cfg.n_embd)
        modules["h"] = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        modules["ln_f"] = nn.LayerNorm(cfg.n_embd)
        self.transformer = nn.ModuleDict(modules)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight
        self.current_pos = 0

    def reset_kv_cache(self):
        self.current_pos = 0
        for blk in self.transformer.h:
            blk.attn.reset_cache()

    def forward(self, idx, use_cache=False):
        B, T = idx.shape
        start_pos = self.current_pos if use_cache else 0
        x = self.transformer.wte(idx)
        if not self.cfg.alibi:
            pos = torch.arange(start_pos, start_pos + T, device=idx.device)
            x = x + self.transformer.wpe(pos)
        for blk in self.transformer.h:
            x = blk(x, start_pos, use_cache)
        if use_cache:
            self.current_pos += T
        return self.lm_head(self.transformer.ln_f(x))


def make_model():
    torch.manual_seed(111)
    model = GPT(Config())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn_like(m.weight))
                m.bias.copy_(0.1 * torch.randn_like(m.bias))
    return model.eval()

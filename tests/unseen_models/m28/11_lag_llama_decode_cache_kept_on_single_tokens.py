"""Lag-Llama (time-series-foundation-models/lag-llama, lag_llama/model/module.py) over token ids.

LagLlamaModel: transformer = ModuleDict(wte, h, ln_f) (wte an embedding here, the lag-feature
Linear in lag-llama), lm_head. Block: rms_1 -> attn -> + x, rms_2 -> mlp (c_fc1 / c_fc2 SwiGLU,
c_proj) -> + x.

CausalSelfAttention: q_proj and a fused kv_proj (2E, split k | v), c_proj, no biases, MHA 4/4,
rotary `rotate_half` (halves) with lag-llama's linear rope scaling (positions / 2.0, base 1e4), and
a declared sliding window (config.sliding_window = 8: a query sees itself and the 7 keys before
it), applied as a mask on absolute positions.

Cache (book-buffers): `model.reset_kv_cache()`, `model(prompt, use_cache=True)`, `model(tok,
use_cache=True)`; each attention module keeps `kv_cache = (k, v, positions)`, concatenated and
trimmed to its last 16 entries (lag-llama's rolling cache), the model keeps the position counter.
Returns logits.

Slip: refresh_cache_every_call False: a module stores its concatenated keys only when it has none
or when the call brings more than one token (written for re-prefills), so a one-token step attends
over the cache plus itself but never saves itself. Step 0 is exact; from step 1 the previous
decoded token is missing in every layer (first in layer 0). Full forward and prompt pass exact.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["transformer.h.0.attn", "transformer.h.1.attn", "transformer.h.2.attn"],
    "kind": "causal-multihead",
    "cache": "book-buffers",
    "decode": {"mistake": "cache_stale", "step": 1, "layer": "transformer.h.0.attn"},
    "style": "lag-llama as 03; single-token calls never write their keys and values back "
    "into kv_cache",
}


class RMSNorm(nn.Module):
    def __init__(self, size, dim=-1, eps=1e-5):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.dim = dim

    def forward(self, x):
        norm_x = x.pow(2).mean(dim=self.dim, keepdim=True)
        return self.scale * (x * torch.rsqrt(norm_x + self.eps))


class LlamaLinearScalingRotaryEmbedding(nn.Module):
    """Positions divided by scaling_factor; cos/sin built in float64 at call time, cast at use."""

    def __init__(self, dim, base=10000.0, scaling_factor=1.0, table_layout="halves"):
        super().__init__()
        self.dim = dim
        self.base = base
        self.scaling_factor = scaling_factor
        self.table_layout = table_layout

    def forward(self, positions, dtype):
        inv_freq = 1.0 / (
            self.base
            ** (
                torch.arange(0, self.dim, 2, dtype=torch.float64, device=positions.device)
                / self.dim
            )
        )
        t = positions.to(torch.float64) / self.scaling_factor
        freqs = torch.outer(t, inv_freq)
        if self.table_layout == "halves":
            emb = torch.cat((freqs, freqs), dim=-1)
        else:  # tables laid out for complex pairs
            emb = freqs.repeat_interleave(2, dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    cos, sin = cos[None, None], sin[None, None]
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class CausalSelfAttention(nn.Module):
    """q_proj + fused kv_proj, c_proj; sliding-window causal mask on absolute positions.

    The module carries its own cache (kv_cache = (k, v, positions), (B, nh, T, hs) layout): new keys
    are concatenated and the oldest dropped past `max_cache_len`, as lag-llama's rolling cache does.
    """

    def __init__(self, config, layer_idx):
        super().__init__()
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.head_size = config.n_embd // config.n_head
        self.q_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.kv_proj = nn.Linear(config.n_embd, 2 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.rotary_emb = LlamaLinearScalingRotaryEmbedding(
            self.head_size,
            base=config.rope_base,
            scaling_factor=config.rope_scaling["factor"],
            table_layout=config.rope_table_layout[layer_idx],
        )
        self.sliding_window = config.sliding_window
        self.window_inclusive = config.window_inclusive[layer_idx]
        self.max_cache_len = config.max_cache_len
        self.refresh_cache_every_call = config.refresh_cache_every_call
        self.kv_cache = None

    def reset_cache(self):
        self.kv_cache = None

    def _window_mask(self, q_pos, k_pos):
        dist = q_pos[:, None] - k_pos[None, :]
        if self.window_inclusive:
            return (dist >= 0) & (dist <= self.sliding_window)
        return (dist >= 0) & (dist < self.sliding_window)

    def forward(self, x, positions, use_kv_cache=False):
        B, T, C = x.size()
        q = self.q_proj(x)
        k, v = self.kv_proj(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, self.head_size).transpose(1, 2)
        k = k.view(B, T, self.n_head, self.head_size).transpose(1, 2)
        v = v.view(B, T, self.n_head, self.head_size).transpose(1, 2)
        cos, sin = self.rotary_emb(positions, q.dtype)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k_pos = positions
        if use_kv_cache:
            if self.kv_cache is not None:
                cache_k, cache_v, cache_pos = self.kv_cache
                k = torch.cat([cache_k, k], dim=2)
                v = torch.cat([cache_v, v], dim=2)
                k_pos = torch.cat([cache_pos, positions])
            if self.kv_cache is None or T > 1 or self.refresh_cache_every_call:
                keep = min(k.shape[2], self.max_cache_len)
                self.kv_cache = (k[:, :, -keep:], v[:, :, -keep:], k_pos[-keep:])
        mask = self._window_mask(positions, k_pos)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(~mask, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        hidden = 2 * config.n_embd
        self.c_fc1 = nn.Linear(config.n_embd, hidden, bias=config.bias)
        self.c_fc2 = nn.Linear(config.n_embd, hidden, bias=config.bias)
        self.c_proj = nn.Linear(hidden, config.n_embd, bias=config.bias)

    def forward(self, x):
        return self.c_proj(F.silu(self.c_fc1(x)) * self.c_fc2(x))


class Block(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.rms_1 = RMSNorm(config.n_embd)
        self.attn = CausalSelfAttention(config, layer_idx)
        self.rms_2 = RMSNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x, positions, use_kv_cache=False):
        x = x + self.attn(self.rms_1(x), positions, use_kv_cache)
        return x + self.mlp(self.rms_2(x))


class LagLlamaModel(nn.Module):
    """lag-llama's tree (transformer.wte / transformer.h / transformer.ln_f) over token ids."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                h=nn.ModuleList([Block(config, i) for i in range(config.n_layer)]),
                ln_f=RMSNorm(config.n_embd),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.y_cache_len = 0

    def reset_kv_cache(self):
        self.y_cache_len = 0
        for block in self.transformer.h:
            block.attn.reset_cache()

    def forward(self, input_ids, use_cache=False):
        T = input_ids.shape[1]
        start = self.y_cache_len if use_cache else 0
        positions = torch.arange(start, start + T, device=input_ids.device)
        x = self.transformer.wte(input_ids)
        for block in self.transformer.h:
            x = block(x, positions, use_kv_cache=use_cache)
        if use_cache:
            self.y_cache_len = start + T
        return self.lm_head(self.transformer.ln_f(x))


def make_model():
    torch.manual_seed(2811)
    config = SimpleNamespace(
        vocab_size=96,
        n_embd=64,
        n_head=4,
        bias=False,
        rope_base=10000.0,
        rope_scaling={"type": "linear", "factor": 2.0},
        sliding_window=8,
        max_cache_len=16,
        n_layer=3,
        rope_table_layout=["halves", "halves", "halves"],
        window_inclusive=[False, False, False],
        refresh_cache_every_call=False,
    )
    model = LagLlamaModel(config)
    g = torch.Generator().manual_seed(28111)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.scale.copy_(1.0 + 0.3 * torch.randn(m.scale.shape, generator=g))
    return model.eval()

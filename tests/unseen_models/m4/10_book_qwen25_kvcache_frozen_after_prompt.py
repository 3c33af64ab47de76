"""As 02 (Qwen2.5, qkv bias, GQA 4/2, rotary base 1e6, LLMs-from-scratch KVCache), written from memory.

Cache (book-cache): cache = mod.KVCache(n_layers=3); model.reset_kv_cache(); model(prompt, cache=cache);
model(tok, cache=cache).  With cache= the model returns the logits tensor and advances model.current_pos.

Slip (decoding only): on a call that finds a cache entry the attention returns the old entry as
its "present" (next_cache = layer_past), so the cache keeps only the prompt.  Step 0 is right (it
sees the prompt and itself); step 1 no longer sees step 0's token.
Decode step 1, model.layers.0.self_attn: cache_stale.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["model.layers.0.self_attn", "model.layers.1.self_attn", "model.layers.2.self_attn"],
    "kind": "causal-multihead",
    "cache": "book-cache",
    "decode": {"mistake": "cache_stale", "step": 1, "layer": "model.layers.0.self_attn"},
    "style": "Qwen2.5 + KVCache(n_layers); slip: the cache is never updated after the prompt",
}

SLIP = "cache_frozen"


class Config:
    vocab_size = 140
    hidden_size = 64
    num_hidden_layers = 3
    num_attention_heads = 4
    num_key_value_heads = 2
    head_dim = 16
    rotary_dim = 16
    interleaved = False
    rope_theta = 1000000.0
    qkv_bias = True
    parallel_block = False
    intermediate_size = 112


class KVCache:
    """List cache with get/update, one slot per layer."""

    def __init__(self, n_layers):
        self.cache = [None] * n_layers

    def get(self, i):
        return self.cache[i]

    def update(self, i, value):
        self.cache[i] = value

    def reset(self):
        self.cache = [None] * len(self.cache)


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.eps))


def rotary_tables(cfg, positions, dtype):
    rd = cfg.rotary_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd))
    ang = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    if cfg.interleaved:
        ang = torch.repeat_interleave(ang, 2, dim=-1)
    else:
        ang = torch.cat((ang, ang), dim=-1)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_every_two(x):
    x1 = x[..., ::2]
    x2 = x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rotary(x, cos, sin, cfg):
    rd = cfg.rotary_dim
    x_rot, x_pass = x[..., :rd], x[..., rd:]
    rot = rotate_every_two if cfg.interleaved else rotate_half
    x_rot = x_rot * cos + rot(x_rot) * sin
    return torch.cat((x_rot, x_pass), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.cfg = cfg
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        d = cfg.hidden_size
        self.q_proj = nn.Linear(d, self.num_heads * self.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, d, bias=cfg.qkv_bias)

    def forward(self, x, cos, sin, past_len, layer_past=None):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        k_plain = k
        q = apply_rotary(q, cos, sin, self.cfg)
        if not (SLIP == "keys_unrotated" and self.layer_idx == 2):
            k = apply_rotary(k, cos, sin, self.cfg)
        if layer_past is not None:
            k = torch.cat((layer_past[0], k), dim=2)
            v = torch.cat((layer_past[1], v), dim=2)
        if SLIP == "cache_unrotated_keys":
            stored_k = k_plain if layer_past is None else torch.cat((layer_past[0], k_plain), dim=2)
            present = (stored_k, v)
        elif SLIP == "cache_frozen" and layer_past is not None:
            present = layer_past
        else:
            present = (k, v)
        S = k.shape[2]
        n_rep = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(n_rep, dim=1)
        v = v.repeat_interleave(n_rep, dim=1)
        scale = 1.0 / math.sqrt(self.head_dim)
        if SLIP == "scale_by_head_dim" and self.layer_idx == 1:
            scale = 1.0 / self.head_dim
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale
        q_pos = torch.arange(past_len, past_len + T, device=x.device)
        k_pos = torch.arange(S, device=x.device)
        future = k_pos[None, :] > q_pos[:, None]
        scores = scores.masked_fill(future, torch.finfo(scores.dtype).min)
        w = torch.softmax(scores, dim=-1)
        ctx = torch.matmul(w, v).transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim)
        return self.o_proj(ctx), present


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg, i):
        super().__init__()
        self.cfg = cfg
        self.input_layernorm = RMSNorm(cfg.hidden_size)
        self.self_attn = Attention(cfg, i)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, past_len, layer_past):
        h = self.input_layernorm(x)
        a, present = self.self_attn(h, cos, sin, past_len, layer_past)
        if self.cfg.parallel_block:
            return x + a + self.mlp(h), present
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x)), present


class Output:
    def __init__(self, logits, past_key_values):
        self.logits = logits
        self.past_key_values = past_key_values


class Inner(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size)


class CausalLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.model = Inner(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.current_pos = 0

    def reset_kv_cache(self):
        self.current_pos = 0

    def forward(self, input_ids, past_key_values=None, use_cache=False, cache=None):
        B, T = input_ids.shape
        if cache is not None:
            past_len = self.current_pos
            self.current_pos += T
        elif past_key_values is not None:
            past_len = past_key_values[0][0].shape[2]
        else:
            past_len = 0
        positions = torch.arange(past_len, past_len + T, device=input_ids.device)
        if SLIP == "positions_from_zero":
            positions = torch.arange(T, device=input_ids.device)
        x = self.model.embed_tokens(input_ids)
        cos, sin = rotary_tables(self.cfg, positions, x.dtype)
        presents = []
        for i, layer in enumerate(self.model.layers):
            if cache is not None:
                lp = cache.get(i)
            else:
                lp = past_key_values[i] if past_key_values is not None else None
            x, present = layer(x, cos, sin, past_len, lp)
            if cache is not None:
                cache.update(i, present)
            presents.append(present)
        logits = self.lm_head(self.model.norm(x))
        if cache is not None:
            return logits
        return Output(logits, tuple(presents) if use_cache else None)


def make_model():
    torch.manual_seed(110)
    model = CausalLM(Config())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn_like(m.weight))
    return model.eval()

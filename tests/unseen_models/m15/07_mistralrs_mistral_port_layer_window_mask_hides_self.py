"""Mistral as written in EricLBuehler's mistral.rs (mistralrs-core/src/models/mistral.rs, Rust on candle),
ported to torch module by module.

Model { embed_tokens, layers: Vec<DecoderLayer>, norm, lm_head, sliding_window }; DecoderLayer
{ self_attn, mlp (gate_proj/up_proj/down_proj, SiLU), input_layernorm, post_attention_layernorm (RmsNorm) };
Attention { q_proj, k_proj, v_proj, o_proj (no bias), num_heads 4, num_kv_heads 2, head_dim 16,
rotary_emb, sliding_window 4 }.  RotaryEmbedding holds sin/cos tables (halves layout, candle's
`rope`, base 1e4) indexed by seqlen_offsets.  The sliding-window causal mask is made by the model's
CausalMasker: key j is hidden from query i when j > i or i - j >= sliding_window (each query sees 4
keys, itself included), filled with finfo(dtype).min; `repeat_kv` (query head h reads kv head h // 2); scores scaled by
1/sqrt(head_dim); softmax; o_proj.
Slip: layer 2 builds its own window mask through `make_sliding_window_mask_exclusive` (a helper of the
port's prefix-cache code, where the current token is already in the cache) whose test is
`j >= i || i - j >= window`: inside its window each query cannot see its own key (the first query
sees no key at all; with the finite fill its weights spread evenly over every key, so nothing is NaN).  Layers 0 and 1 use the
model's mask and are correct.  No cache.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["layers.0.self_attn", "layers.1.self_attn", "layers.2.self_attn"],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "layers.2.self_attn",
    "stage": "masked_scores",
    "mistake": "mask_diagonal",
    "style": "mistral.rs Mistral port: q/k/v/o GQA 4/2 repeat_kv, candle halves rope base 1e4 with seqlen_offsets, "
    "CausalMasker sliding window 4 (finfo.min); layer 2 rebuilds an exclusive window mask that hides each query's own key",
}


def make_sliding_window_mask(tgt_len, sliding_window, device):
    i = torch.arange(tgt_len, device=device).view(-1, 1)
    j = torch.arange(tgt_len, device=device).view(1, -1)
    return (j > i) | (i - j >= sliding_window)


def make_sliding_window_mask_exclusive(tgt_len, sliding_window, device):
    i = torch.arange(tgt_len, device=device).view(-1, 1)
    j = torch.arange(tgt_len, device=device).view(1, -1)
    return (j >= i) | (i - j >= sliding_window)


class RotaryEmbedding(nn.Module):
    def __init__(self, base, head_dim, max_position_embeddings):
        super().__init__()
        inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        freqs = torch.outer(torch.arange(max_position_embeddings, dtype=torch.float64), inv_freq)
        self.sin = freqs.sin()
        self.cos = freqs.cos()

    def forward(self, q, k, seqlen_offset):
        s = q.shape[2]
        cos = self.cos[seqlen_offset : seqlen_offset + s].to(q.device, q.dtype)
        sin = self.sin[seqlen_offset : seqlen_offset + s].to(q.device, q.dtype)
        cos = torch.cat([cos, cos], dim=-1)
        sin = torch.cat([sin, sin], dim=-1)

        def rope(x):
            x1, x2 = x.chunk(2, dim=-1)
            return x * cos + torch.cat([-x2, x1], dim=-1) * sin

        return rope(q), rope(k)


class Attention(nn.Module):
    def __init__(self, cfg, rotary_emb, exclusive_mask=False):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.sliding_window = cfg.sliding_window
        self.exclusive_mask = exclusive_mask
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.rotary_emb = rotary_emb

    def repeat_kv(self, x):
        n_rep = self.num_heads // self.num_kv_heads
        b, kv, s, d = x.shape
        return x.unsqueeze(2).expand(b, kv, n_rep, s, d).reshape(b, kv * n_rep, s, d)

    def forward(self, xs, attention_mask, seqlen_offset=0):
        b, q_len, _ = xs.shape
        q = self.q_proj(xs).reshape(b, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(xs).reshape(b, q_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(xs).reshape(b, q_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = self.rotary_emb(q, k, seqlen_offset)
        k = self.repeat_kv(k)
        v = self.repeat_kv(v)
        if self.exclusive_mask:
            attention_mask = make_sliding_window_mask_exclusive(q_len, self.sliding_window, xs.device)
        att = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.head_dim)
        att = att.masked_fill(attention_mask, torch.finfo(att.dtype).min)
        att = torch.softmax(att, dim=-1)
        out = torch.matmul(att, v).transpose(1, 2).reshape(b, q_len, self.num_heads * self.head_dim)
        return self.o_proj(out)


class RmsNorm(nn.Module):
    def __init__(self, size, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Mlp(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg, rotary_emb, exclusive_mask=False):
        super().__init__()
        self.self_attn = Attention(cfg, rotary_emb, exclusive_mask)
        self.mlp = Mlp(cfg)
        self.input_layernorm = RmsNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RmsNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, xs, attention_mask, seqlen_offset=0):
        xs = xs + self.self_attn(self.input_layernorm(xs), attention_mask, seqlen_offset)
        return xs + self.mlp(self.post_attention_layernorm(xs))


class Model(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.sliding_window = cfg.sliding_window
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        rotary_emb = RotaryEmbedding(cfg.rope_theta, cfg.hidden_size // cfg.num_attention_heads,
                                     cfg.max_position_embeddings)
        self.layers = nn.ModuleList(
            [DecoderLayer(cfg, rotary_emb, exclusive_mask=(i == 2)) for i in range(cfg.num_hidden_layers)]
        )
        self.norm = RmsNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids):
        xs = self.embed_tokens(input_ids)
        mask = make_sliding_window_mask(input_ids.shape[1], self.sliding_window, input_ids.device)
        for layer in self.layers:
            xs = layer(xs, mask, 0)
        return self.lm_head(self.norm(xs))


def make_model():
    torch.manual_seed(1507)
    cfg = SimpleNamespace(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=64,
        sliding_window=4,
    )
    model = Model(cfg)
    g = torch.Generator().manual_seed(15071)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RmsNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

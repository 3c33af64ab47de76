"""A tiny Yi (llama architecture) with an exllama-style preallocated cache inside each attention.

YiForCausalLM -> model (embed_tokens, layers ModuleList, norm) + lm_head.  Attention: q/k/v/o_proj
without bias, GQA 6 query heads / 2 kv heads of 8 (hidden 48), interleaved-pair rotary computed
with real cos/sin on (even, odd) feature pairs (base 5e6, as Yi), explicit matmul with a boolean
causal mask offset by the cache length, kv heads expanded with repeat_interleave.
Each attention owns static buffers cache_k / cache_v of (8, 2, 64, 8) (batch <= 8, 64 positions),
written at [start_pos, start_pos + T) and read over [0, start_pos + T); the model keeps
current_pos for the positions and the mask, the attention keeps its own fill counter for writes.

Cache (book-buffers): model.reset_kv_cache(); model(prompt, use_cache=True); model(tok,
use_cache=True).  A plain model(ids) uses no cache.

Slip (decoding only): the fill counter is assigned, `self.filled = T`, instead of advanced
(`+=`).  The prompt is stored at 0..P-1 and step 0 at slot P, both right; but after step 0 the
counter reads 1, so step 1 writes its key/value over the prompt's slot 1 and its own slot P + 1
is left empty (zeros) while it is read.  Step 0 matches; step 1 diverges in
model.layers.0.self_attn: cache_stale.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["model.layers.0.self_attn", "model.layers.1.self_attn", "model.layers.2.self_attn"],
    "kind": "causal-multihead",
    "cache": "book-buffers",
    "decode": {"mistake": "cache_stale", "step": 1, "layer": "model.layers.0.self_attn"},
    "style": "Yi/llama with exllama-style preallocated per-attention cache buffers, interleaved real rotary, "
    "GQA 6/2; slip: write counter assigned (filled = T) instead of advanced",
}


class YiConfig:
    vocab_size = 120
    hidden_size = 48
    intermediate_size = 96
    num_hidden_layers = 3
    num_attention_heads = 6
    num_key_value_heads = 2
    rope_theta = 5_000_000.0
    rms_norm_eps = 1e-5
    max_batch_size = 8
    max_seq_len = 64


class YiRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rope_tables(head_dim, positions, base, dtype):
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    ang = positions.to(torch.float64)[:, None] * inv[None, :]
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rope_pairs(x, cos, sin):
    # x: (b, h, t, d); pairs (0,1), (2,3), ...
    x_even, x_odd = x[..., 0::2], x[..., 1::2]
    out_even = x_even * cos - x_odd * sin
    out_odd = x_even * sin + x_odd * cos
    return torch.stack((out_even, out_odd), dim=-1).flatten(-2)


class YiAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.n_rep = self.num_heads // self.num_kv_heads
        self.rope_theta = config.rope_theta
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        shape = (config.max_batch_size, self.num_kv_heads, config.max_seq_len, self.head_dim)
        self.register_buffer("cache_k", torch.zeros(shape), persistent=False)
        self.register_buffer("cache_v", torch.zeros(shape), persistent=False)
        self.filled = 0

    def reset_cache(self):
        self.cache_k.zero_()
        self.cache_v.zero_()
        self.filled = 0

    def forward(self, x, start_pos=0, use_cache=False):
        bsz, T, _ = x.shape
        q = self.q_proj(x).view(bsz, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(bsz, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(bsz, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        positions = torch.arange(start_pos, start_pos + T, device=x.device)
        cos, sin = rope_tables(self.head_dim, positions, self.rope_theta, x.dtype)
        q = apply_rope_pairs(q, cos, sin)
        k = apply_rope_pairs(k, cos, sin)
        if use_cache:
            if self.cache_k.dtype != x.dtype:
                self.cache_k = self.cache_k.to(x.dtype)
                self.cache_v = self.cache_v.to(x.dtype)
            w = self.filled
            self.cache_k[:bsz, :, w : w + T] = k
            self.cache_v[:bsz, :, w : w + T] = v
            self.filled = T  # SLIP
            k = self.cache_k[:bsz, :, : start_pos + T]
            v = self.cache_v[:bsz, :, : start_pos + T]
        k = k.repeat_interleave(self.n_rep, dim=1)
        v = v.repeat_interleave(self.n_rep, dim=1)
        S = k.shape[2]
        scores = torch.matmul(q, k.transpose(-1, -2)) / self.head_dim**0.5
        q_pos = torch.arange(start_pos, start_pos + T, device=x.device)[:, None]
        k_pos = torch.arange(S, device=x.device)[None, :]
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        probs = F.softmax(scores, dim=-1)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(bsz, T, -1)
        return self.o_proj(out)


class YiMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class YiDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = YiAttention(config)
        self.mlp = YiMLP(config)
        self.ln1 = YiRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.ln2 = YiRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, start_pos=0, use_cache=False):
        x = x + self.self_attn(self.ln1(x), start_pos, use_cache)
        return x + self.mlp(self.ln2(x))


class YiModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [YiDecoderLayer(config) for _ in range(config.num_hidden_layers)]
        )
        self.norm = YiRMSNorm(config.hidden_size, config.rms_norm_eps)


class YiForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = YiModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.current_pos = 0

    def reset_kv_cache(self):
        self.current_pos = 0
        for layer in self.model.layers:
            layer.self_attn.reset_cache()

    def forward(self, input_ids, use_cache=False):
        T = input_ids.shape[1]
        start_pos = self.current_pos if use_cache else 0
        h = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            h = layer(h, start_pos, use_cache)
        if use_cache:
            self.current_pos += T
        return self.lm_head(self.model.norm(h))


def make_model():
    torch.manual_seed(14)
    model = YiForCausalLM(YiConfig())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, YiRMSNorm):
                m.weight.copy_(1.0 + 0.25 * torch.randn_like(m.weight))
    return model.eval()

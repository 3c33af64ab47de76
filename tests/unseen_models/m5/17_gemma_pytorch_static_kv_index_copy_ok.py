"""Gemma as written in Google's own PyTorch repository (gemma_pytorch's gemma/model.py, written from
memory, in my own words -- not transformers' modeling_gemma): `embedder` scaled by
sqrt(hidden_size), `model.layers.N.self_attn` with one fused `qkv_proj` split by size and `o_proj`,
queries multiplied by `scaling` = head_dim^-0.5, rotary through complex numbers --
view_as_complex(stack(chunk(x, 2))) so the complex pairs are the two *halves* of each head, base
10000 -- per-layer preallocated (k_cache, v_cache) tensors written with index_copy_ at the input
positions, a model-level -inf mask buffer indexed by the input positions (and the attention reads
the whole static cache under that mask), RMSNorm with (1 + weight), GeGLU MLP, tied output
through the embedder.  MHA 4 heads of 16, 3 layers.

Cache (book-buffers): model.reset_kv_cache(); model(prompt, use_cache=True); model(tok, use_cache=True).
The position counter lives in the model; buffers hold batch <= 8 and 64 positions.  A plain call
(use_cache=False) writes to scratch buffers and starts at position 0.  `model(tokens, start_pos=n,
use_cache=True)` overrides the counter (Meta style).

Correct.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": ["model.layers.0.self_attn", "model.layers.1.self_attn", "model.layers.2.self_attn"],
    "kind": "causal-multihead",
    "cache": "book-buffers",
    "structure": {
        "heads": 4,
        "kv_heads": 4,
        "head_dim": 16,
        "causal": True,
        "cross": False,
        "rope": {"pairing": "half", "fraction": 1.0, "base": 10000.0},
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "gemma_pytorch model.py: fused qkv_proj, complex rotary on halves (view_as_complex of chunked halves), "
    "index_copy_ into static per-layer kv caches, mask buffer indexed by input positions, (1+w) RMSNorm",
}


class GemmaConfig:
    vocab_size = 180
    max_position_embeddings = 64
    max_batch_size = 8
    num_hidden_layers = 3
    num_attention_heads = 4
    num_key_value_heads = 4
    hidden_size = 64
    intermediate_size = 112
    head_dim = 16
    rms_norm_eps = 1e-6


def precompute_freqs_cis(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64)[: (dim // 2)] / dim))
    t = torch.arange(end, dtype=torch.float64)
    freqs = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(freqs), freqs)  # complex128


def apply_rotary_emb(x, freqs_cis):
    """x: (b, s, h, d); pairs are (x[..., i], x[..., i + d/2])."""
    dtype = x.dtype
    work = torch.float64
    x_ = torch.view_as_complex(
        torch.stack(torch.chunk(x.transpose(1, 2).to(work), 2, dim=-1), dim=-1)
    )
    x_out = torch.view_as_real(x_ * freqs_cis[None, None])
    x_out = torch.cat(torch.chunk(x_out, 2, dim=-1), dim=-2)
    x_out = x_out.reshape(x_out.shape[0], x_out.shape[1], x_out.shape[2], -1).transpose(1, 2)
    return x_out.to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return out * (1 + self.weight)


class GemmaMLP(nn.Module):
    def __init__(self, hidden_size, intermediate_size):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class GemmaAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.num_queries_per_kv = self.num_heads // self.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scaling = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)

    def forward(self, hidden_states, freqs_cis, kv_write_indices, kv_cache, mask):
        batch_size, input_len, _ = hidden_states.shape
        qkv = self.qkv_proj(hidden_states)
        xq, xk, xv = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        xq = xq.view(batch_size, -1, self.num_heads, self.head_dim)
        xk = xk.view(batch_size, -1, self.num_kv_heads, self.head_dim)
        xv = xv.view(batch_size, -1, self.num_kv_heads, self.head_dim)
        xq = apply_rotary_emb(xq, freqs_cis)
        xk = apply_rotary_emb(xk, freqs_cis)
        k_cache, v_cache = kv_cache
        k_cache[:batch_size].index_copy_(1, kv_write_indices, xk)
        v_cache[:batch_size].index_copy_(1, kv_write_indices, xv)
        key = k_cache[:batch_size]
        value = v_cache[:batch_size]
        if self.num_kv_heads != self.num_heads:
            key = torch.repeat_interleave(key, self.num_queries_per_kv, dim=2)
            value = torch.repeat_interleave(value, self.num_queries_per_kv, dim=2)
        q = xq.transpose(1, 2) * self.scaling
        k = key.transpose(1, 2)
        v = value.transpose(1, 2)
        scores = torch.matmul(q, k.transpose(2, 3))
        scores = scores + mask
        scores = F.softmax(scores, dim=-1)
        output = torch.matmul(scores, v)
        output = output.transpose(1, 2).contiguous().view(batch_size, input_len, -1)
        return self.o_proj(output)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = GemmaAttention(config)
        self.mlp = GemmaMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, freqs_cis, kv_write_indices, kv_cache, mask):
        residual = hidden_states
        hidden_states = self.self_attn(
            self.input_layernorm(hidden_states), freqs_cis, kv_write_indices, kv_cache, mask
        )
        hidden_states = residual + hidden_states
        residual = hidden_states
        return residual + self.mlp(self.post_attention_layernorm(hidden_states))


class GemmaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList(
            [GemmaDecoderLayer(config) for _ in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, freqs_cis, kv_write_indices, kv_caches, mask):
        for i, layer in enumerate(self.layers):
            hidden_states = layer(hidden_states, freqs_cis, kv_write_indices, kv_caches[i], mask)
        return self.norm(hidden_states)


class GemmaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embedder = nn.Embedding(config.vocab_size, config.hidden_size)
        self.model = GemmaModel(config)
        self.register_buffer(
            "freqs_cis",
            precompute_freqs_cis(config.head_dim, config.max_position_embeddings * 2),
            persistent=False,
        )
        mask = torch.full(
            (config.max_position_embeddings, config.max_position_embeddings), float("-inf")
        )
        self.register_buffer("mask_tensor", torch.triu(mask, diagonal=1), persistent=False)
        self.current_pos = 0
        self.kv_caches = None
        self.scratch = None

    def _alloc(self, dtype):
        c = self.config
        shape = (c.max_batch_size, c.max_position_embeddings, c.num_key_value_heads, c.head_dim)
        return [
            (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
            for _ in range(c.num_hidden_layers)
        ]

    def reset_kv_cache(self):
        self.current_pos = 0
        self.kv_caches = None

    def forward(self, input_token_ids, use_cache=False, start_pos=None):
        dtype = self.embedder.weight.dtype
        seq_len = input_token_ids.shape[1]
        if use_cache:
            if self.kv_caches is None or self.kv_caches[0][0].dtype != dtype:
                self.kv_caches = self._alloc(dtype)
            if start_pos is not None:
                self.current_pos = start_pos
            start, kv_caches = self.current_pos, self.kv_caches
            self.current_pos += seq_len
        else:
            start, kv_caches = 0, self._alloc(dtype)
        input_positions = torch.arange(start, start + seq_len)
        freqs_cis = self.freqs_cis.index_select(0, input_positions)
        mask = self.mask_tensor.index_select(0, input_positions).to(dtype)[None, None]
        hidden_states = self.embedder(input_token_ids)
        hidden_states = hidden_states * torch.tensor(self.config.hidden_size**0.5, dtype=dtype)
        hidden_states = self.model(hidden_states, freqs_cis, input_positions, kv_caches, mask)
        return torch.matmul(hidden_states, self.embedder.weight.t())


def make_model():
    torch.manual_seed(6717)
    model = GemmaForCausalLM(GemmaConfig())
    with torch.no_grad():
        model.embedder.weight.mul_(0.15)
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(0.3 * torch.randn_like(m.weight))
    return model.eval()

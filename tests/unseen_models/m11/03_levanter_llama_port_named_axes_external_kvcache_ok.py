"""Stanford CRFM levanter (src/levanter/models/llama.py, haliax named axes) ported to PyTorch.

LlamaLMHeadModel: embeddings (LlamaEmbedding: token_embeddings), transformer (LlamaTransformer:
layers.N, norm), lm_head.  LlamaDecoderLayer: input_layernorm, self_attn, post_attention_layernorm, mlp.
The haliax axes are kept as einsum subscripts: q is laid out (batch, pos, kv_heads, q_heads_per_group,
head_size) straight from q_proj, so query head h = kv * group + g reads kv head h // group (GQA 6/2
without any repeat); k/v are (batch, pos, kv_heads, head_size).  Rotary is levanter's DefaultRotaryEmbeddings
(rotate_half, theta 5e5) at explicit positions; the scores einsum divides the queries by sqrt(head_size)
first; the causal mask is a boolean `AttentionMask.causal()` where(-1e9).
Cache: external `KVCache(n_layers=3)` passed as `cache=` (levanter's decode KvPageCache reduced to one page
per layer; start position read from the cache); logits tensor.  Correct.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": ["transformer.layers.0.self_attn", "transformer.layers.1.self_attn", "transformer.layers.2.self_attn"],
    "kind": "causal-multihead",
    "cache": "book-cache",
    "style": "levanter llama.py ported: haliax axes as einsum strings, q as (kv_heads, q_heads_per_group) with no repeat "
    "(GQA 6/2), rotate_half theta 5e5, external KVCache(n_layers) via cache=",
}


class KVCache:
    def __init__(self, n_layers):
        self.n_layers = n_layers
        self.reset()

    def reset(self):
        self.keys = [None] * self.n_layers
        self.values = [None] * self.n_layers

    @property
    def length(self):
        return 0 if self.keys[0] is None else self.keys[0].shape[1]

    def extend(self, layer_idx, k, v):
        if self.keys[layer_idx] is None:
            self.keys[layer_idx], self.values[layer_idx] = k, v
        else:
            self.keys[layer_idx] = torch.cat([self.keys[layer_idx], k], dim=1)
            self.values[layer_idx] = torch.cat([self.values[layer_idx], v], dim=1)
        return self.keys[layer_idx], self.values[layer_idx]


class LlamaRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        var = torch.mean(torch.square(x), dim=-1, keepdim=True)
        return x * torch.rsqrt(var + self.eps) * self.weight


class DefaultRotaryEmbeddings(nn.Module):
    def __init__(self, head_size, theta=500000.0):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, head_size, 2, dtype=torch.float64) / head_size),
                             persistent=False)

    def forward(self, x, pos):
        # x: (batch, pos, ..., head_size)
        freqs = torch.einsum("p,f->pf", pos.to(torch.float64), self.inv_freq.to(torch.float64))
        emb = torch.cat([freqs, freqs], dim=-1)
        shape = [1, emb.shape[0]] + [1] * (x.ndim - 3) + [emb.shape[1]]
        cos, sin = emb.cos().reshape(shape).to(x.dtype), emb.sin().reshape(shape).to(x.dtype)
        half = x.shape[-1] // 2
        rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rot * sin


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.kv_heads = config.num_kv_heads
        self.q_heads_per_group = config.num_heads // config.num_kv_heads
        self.head_size = config.hidden_dim // config.num_heads
        self.q_proj = nn.Linear(config.hidden_dim, config.num_heads * self.head_size, bias=False)
        self.k_proj = nn.Linear(config.hidden_dim, self.kv_heads * self.head_size, bias=False)
        self.v_proj = nn.Linear(config.hidden_dim, self.kv_heads * self.head_size, bias=False)
        self.o_proj = nn.Linear(config.num_heads * self.head_size, config.hidden_dim, bias=False)
        self.rot_embs = DefaultRotaryEmbeddings(self.head_size, config.rope_theta)

    def forward(self, x, pos, mask, cache=None):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.kv_heads, self.q_heads_per_group, self.head_size)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.head_size)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_size)
        q = self.rot_embs(q, pos)
        k = self.rot_embs(k, pos)
        if cache is not None:
            k, v = cache.extend(self.layer_idx, k, v)
        q = q / math.sqrt(self.head_size)
        scores = torch.einsum("bqkgd,bskd->bkgqs", q, k)
        scores = torch.where(mask, scores, torch.full_like(scores, -1e9))
        weights = torch.softmax(scores, dim=-1)
        attn = torch.einsum("bkgqs,bskd->bqkgd", weights, v)
        return self.o_proj(attn.reshape(b, s, -1))


class LlamaMlp(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_dim, config.intermediate_dim, bias=False)
        self.up_proj = nn.Linear(config.hidden_dim, config.intermediate_dim, bias=False)
        self.down_proj = nn.Linear(config.intermediate_dim, config.hidden_dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx)
        self.mlp = LlamaMlp(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_dim)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_dim)

    def forward(self, x, pos, mask, cache=None):
        x = x + self.self_attn(self.input_layernorm(x), pos, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaTransformer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, i) for i in range(config.num_layers)])
        self.norm = LlamaRMSNorm(config.hidden_dim)

    def forward(self, x, pos, mask, cache=None):
        for layer in self.layers:
            x = layer(x, pos, mask, cache)
        return self.norm(x)


class LlamaEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.token_embeddings = nn.Embedding(config.vocab_size, config.hidden_dim)

    def forward(self, input_ids):
        return self.token_embeddings(input_ids)


class Config:
    vocab_size = 96
    hidden_dim = 96
    intermediate_dim = 192
    num_layers = 3
    num_heads = 6
    num_kv_heads = 2
    rope_theta = 500000.0


class LlamaLMHeadModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embeddings = LlamaEmbedding(config)
        self.transformer = LlamaTransformer(config)
        self.lm_head = nn.Linear(config.hidden_dim, config.vocab_size, bias=False)

    def forward(self, input_ids, cache=None):
        s = input_ids.shape[1]
        start = 0 if cache is None else cache.length
        pos = torch.arange(start, start + s, device=input_ids.device)
        key_pos = torch.arange(start + s, device=input_ids.device)
        mask = key_pos[None, :] <= pos[:, None]  # (q, s) True = attend
        x = self.embeddings(input_ids)
        x = self.transformer(x, pos, mask, cache)
        return self.lm_head(x)


def make_model():
    torch.manual_seed(1103)
    model = LlamaLMHeadModel(Config())
    g = torch.Generator().manual_seed(11031)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LlamaRMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

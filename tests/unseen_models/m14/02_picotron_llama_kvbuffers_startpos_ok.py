"""picotron (huggingface/picotron) model.py Llama, with a serving KV buffer added, reduced.

Llama: embedding, decoder_layers.N (DecoderLayer: input_layernorm, attention, post_attention_layernorm,
mlp), final_norm, final_proj.  Attention: q_proj/k_proj/v_proj/out_proj without bias, cos/sin tables
from get_cos_sin (halves layout, base 5e5, float64 then cast), apply_rotary_pos_emb with rotate_half,
GQA 6/2 with repeat_interleave on the head axis, SDPA with an explicit boolean mask.  MLP:
up_proj/gate_proj/down_proj, SiLU.
Cache: book-buffers.  Each Attention owns `cache_k`/`cache_v` buffers (4, kv, 64, d).  Either
`model(prompt, start_pos=0)`, `model(tok, start_pos=L)`, or `model.reset_kv_cache()`,
`model(prompt, use_cache=True)`, `model(tok, use_cache=True)`.  `model(ids)` touches no cache.  Returns
logits.  Correct.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": [
        "decoder_layers.0.attention",
        "decoder_layers.1.attention",
        "decoder_layers.2.attention",
    ],
    "kind": "causal-multihead",
    "cache": "book-buffers",
    "style": "picotron model.py Llama: decoder_layers/attention/out_proj, get_cos_sin halves tables base 5e5, "
    "GQA 6/2 repeat_interleave, SDPA boolean mask; cache_k/cache_v buffers written at start_pos",
}

MAX_BATCH = 4
MAX_SEQ = 64


def get_cos_sin(seq_length, head_dim, base=500000.0):
    theta = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    position = torch.arange(seq_length, dtype=torch.float64).unsqueeze(1)
    angles = position * theta.unsqueeze(0)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary_pos_emb(x, cos, sin):
    head_dim = x.size(-1)
    x1 = x[..., : head_dim // 2]
    x2 = x[..., head_dim // 2 :]
    rotate_half = torch.cat([-x2, x1], dim=-1)
    return x * cos + rotate_half * sin


class TritonRMSNorm(nn.Module):  # picotron's name; plain torch here
    def __init__(self, hidden_size, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class Attention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.hidden_size = config["hidden_size"]
        self.num_heads = config["num_attention_heads"]
        self.num_key_values = config["num_key_value_heads"]
        self.head_dim = self.hidden_size // self.num_heads
        self.num_local_heads = self.num_heads
        self.num_local_kv_heads = self.num_key_values
        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(self.hidden_size, self.num_key_values * self.head_dim, bias=False)
        self.v_proj = nn.Linear(self.hidden_size, self.num_key_values * self.head_dim, bias=False)
        self.out_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=False)
        self.layer_idx = layer_idx
        self.register_buffer("cache_k", torch.zeros(MAX_BATCH, self.num_key_values, MAX_SEQ, self.head_dim), persistent=False)
        self.register_buffer("cache_v", torch.zeros(MAX_BATCH, self.num_key_values, MAX_SEQ, self.head_dim), persistent=False)

    def forward(self, x, cos, sin, start_pos=None):
        batch_size, seq_length, _ = x.size()
        q = self.q_proj(x).view(batch_size, seq_length, self.num_local_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch_size, seq_length, self.num_local_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch_size, seq_length, self.num_local_kv_heads, self.head_dim).transpose(1, 2)
        q = apply_rotary_pos_emb(q, cos, sin)
        k = apply_rotary_pos_emb(k, cos, sin)
        if start_pos is not None:
            if self.cache_k.dtype != k.dtype:
                self.cache_k = self.cache_k.to(k.dtype)
                self.cache_v = self.cache_v.to(v.dtype)
            self.cache_k[:batch_size, :, start_pos : start_pos + seq_length] = k
            self.cache_v[:batch_size, :, start_pos : start_pos + seq_length] = v
            k = self.cache_k[:batch_size, :, : start_pos + seq_length]
            v = self.cache_v[:batch_size, :, : start_pos + seq_length]
            offset = start_pos
        else:
            offset = 0
        k = k.repeat_interleave(self.num_local_heads // self.num_local_kv_heads, dim=1)
        v = v.repeat_interleave(self.num_local_heads // self.num_local_kv_heads, dim=1)
        q_pos = torch.arange(offset, offset + seq_length)
        k_pos = torch.arange(k.size(2))
        allowed = k_pos[None, :] <= q_pos[:, None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        out = out.transpose(1, 2).reshape(batch_size, seq_length, self.num_local_heads * self.head_dim)
        return self.out_proj(out)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.up_proj = nn.Linear(config["hidden_size"], config["intermediate_size"], bias=False)
        self.gate_proj = nn.Linear(config["hidden_size"], config["intermediate_size"], bias=False)
        self.down_proj = nn.Linear(config["intermediate_size"], config["hidden_size"], bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.input_layernorm = TritonRMSNorm(config["hidden_size"], eps=config["rms_norm_eps"])
        self.attention = Attention(config, layer_idx)
        self.post_attention_layernorm = TritonRMSNorm(config["hidden_size"], eps=config["rms_norm_eps"])
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, start_pos=None):
        x = x + self.attention(self.input_layernorm(x), cos, sin, start_pos)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.head_dim = config["hidden_size"] // config["num_attention_heads"]
        self.embedding = nn.Embedding(config["vocab_size"], config["hidden_size"])
        self.decoder_layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config["num_hidden_layers"]))
        self.final_norm = TritonRMSNorm(config["hidden_size"], eps=config["rms_norm_eps"])
        self.final_proj = nn.Linear(config["hidden_size"], config["vocab_size"], bias=False)
        self._pos = 0

    def reset_kv_cache(self):
        self._pos = 0
        for layer in self.decoder_layers:
            layer.attention.cache_k.zero_()
            layer.attention.cache_v.zero_()

    def forward(self, input_ids, start_pos=None, use_cache=False):
        if start_pos is None and use_cache:
            start_pos = self._pos
        seq_length = input_ids.size(1)
        offset = start_pos if start_pos is not None else 0
        cos, sin = get_cos_sin(offset + seq_length, self.head_dim, base=self.config["rope_theta"])
        x = self.embedding(input_ids)
        cos = cos[offset:].to(x.dtype)
        sin = sin[offset:].to(x.dtype)
        for layer in self.decoder_layers:
            x = layer(x, cos, sin, start_pos)
        if start_pos is not None:
            self._pos = start_pos + seq_length
        return self.final_proj(self.final_norm(x))


def make_model():
    torch.manual_seed(1402)
    config = dict(vocab_size=96, hidden_size=96, intermediate_size=192, num_hidden_layers=3,
                  num_attention_heads=6, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=500000.0)
    model = Llama(config)
    g = torch.Generator().manual_seed(14021)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, TritonRMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

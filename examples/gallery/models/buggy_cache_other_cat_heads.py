"""A hand-written Hugging Face-style causal LM that joins its cache along the wrong axis.

The cached keys and values are ``(batch, heads, tokens, head_dim)``, and the new ones are
concatenated to them along dim 1, the heads: the full pass never takes that path and is
right, and the first cached step raises. Reported as ``cache_other`` with the exception and
the line it came from.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "kind": "model",
    "ok": False,
    "decode": {"mistake": "cache_other", "step": 0, "layer": "layers.0.self_attn"},
}


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def rope_tables(head_dim, positions, base=10000.0):
    inv = 1.0 / base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = positions.float()[:, None] * inv[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads, self.head_dim = heads, d // heads
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(self, hidden_states, cos, sin, past=None):
        b, n, d = hidden_states.shape
        shape = (b, n, self.heads, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if past is not None:
            k = torch.cat([past[0], k], dim=1)  # bug: dim 1 holds the heads
            v = torch.cat([past[1], v], dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=past is None)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, d)), (k, v)


class DecoderLayer(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.input_layernorm = RMSNorm(d)
        self.post_attention_layernorm = RMSNorm(d)
        self.self_attn = Attention(d, heads)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.SiLU(), nn.Linear(2 * d, d))

    def forward(self, x, cos, sin, past=None):
        a, present = self.self_attn(self.input_layernorm(x), cos, sin, past)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x)), present


class TinyCausalLM(nn.Module):
    def __init__(self, vocab_size=50, hidden_size=32, num_heads=4, num_layers=2):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(hidden_size, num_heads) for _ in range(num_layers))
        self.norm = RMSNorm(hidden_size)
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)
        self.head_dim = hidden_size // num_heads

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        n = input_ids.shape[1]
        offset = 0 if past_key_values is None else past_key_values[0][0].shape[2]
        cos, sin = rope_tables(self.head_dim, torch.arange(offset, offset + n))
        x = self.embed_tokens(input_ids)
        presents = []
        for i, layer in enumerate(self.layers):
            past = None if past_key_values is None else past_key_values[i]
            x, present = layer(x, cos, sin, past)
            presents.append(present)
        logits = self.lm_head(self.norm(x))
        return (logits, tuple(presents)) if use_cache else (logits,)


def make_model():
    torch.manual_seed(0)
    return TinyCausalLM()

"""GPT-BigCode / SantaCoder style multi-query attention: one fused c_attn that
produces embed_dim queries and a single shared key and value head
(embed_dim + 2 * head_dim outputs), learned absolute positions in the model
(wpe), GPT-2 style block with ln_1 in front of attention.
"""

import math

import torch
from torch import nn


class GPTBigCodeAttention(nn.Module):
    def __init__(self, embed_dim=64, num_heads=4):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.kv_dim = self.head_dim  # multi_query
        self.c_attn = nn.Linear(embed_dim, embed_dim + 2 * self.kv_dim)
        self.c_proj = nn.Linear(embed_dim, embed_dim)
        self.scale_attn_weights = True

    def _attn(self, query, key, value, causal_mask):
        # query: (b, t, h*d) -> (b, t*h, d); key: (b, d, t); value: (b, t, d)
        b, t, _ = query.shape
        scale = 1.0 / math.sqrt(self.head_dim) if self.scale_attn_weights else 1.0
        q = query.reshape(b, t * self.num_heads, self.head_dim)
        w = torch.bmm(q, key) * scale  # (b, t*h, t)
        w = w.view(b, t, self.num_heads, t)
        w = torch.where(
            causal_mask[None, :, None, :], w, torch.full_like(w, torch.finfo(w.dtype).min)
        )
        w = nn.functional.softmax(w, dim=-1)
        out = torch.bmm(w.view(b, t * self.num_heads, t), value)
        return out.view(b, t, self.num_heads * self.head_dim)

    def forward(self, hidden_states, causal_mask):
        query, key_value = self.c_attn(hidden_states).split(
            (self.embed_dim, 2 * self.kv_dim), dim=2
        )
        key, value = key_value.split((self.head_dim, self.head_dim), dim=-1)
        out = self._attn(query, key.transpose(1, 2), value, causal_mask)
        return self.c_proj(out)


class GPTBigCodeBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.wpe = nn.Embedding(64, 64)
        self.ln_1 = nn.LayerNorm(64)
        self.attn = GPTBigCodeAttention()
        self.register_buffer(
            "bias", torch.tril(torch.ones(64, 64, dtype=torch.bool)), persistent=False
        )

    def forward(self, hidden_states):
        t = hidden_states.shape[1]
        hidden_states = hidden_states + self.wpe(torch.arange(t))[None]
        return hidden_states + self.attn(self.ln_1(hidden_states), self.bias[:t, :t])


def make_bigcode():
    torch.manual_seed(3)
    blk = GPTBigCodeBlock()
    with torch.no_grad():
        blk.ln_1.weight.uniform_(0.6, 1.4)
    return blk


EXPECT = {
    "target": "make_bigcode",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "attn",
    "structure": {
        "heads": 4,
        "kv_heads": 1,
        "head_dim": 16,
        "causal": True,
        "cross": False,
        "rope": None,
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "HF GPTBigCode (SantaCoder/StarCoder-1) multi_query: fused c_attn split (embed_dim, 2*head_dim), "
    "queries folded to (b, t*h, d) and bmm against the single key head, boolean causal buffer",
}

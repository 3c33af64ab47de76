"""GPT-BigCode-style attention (c_attn, c_proj, multi_query=False); bug: output dropout via F.dropout without training=self.training, so it is on in eval."""

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn


class GPTBigCodeAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_dim = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.embed_dim // self.num_heads
        self.multi_query = config.multi_query
        assert not self.multi_query, "only the multi-head variant is kept"
        self.scale_attn_weights = config.scale_attn_weights
        self.c_attn = nn.Linear(self.embed_dim, 3 * self.embed_dim)
        self.c_proj = nn.Linear(self.embed_dim, self.embed_dim)
        self.attn_pdrop = config.attn_pdrop
        self.resid_pdrop = config.resid_pdrop
        n = config.max_position_embeddings
        self.register_buffer(
            "bias", torch.tril(torch.ones((n, n), dtype=torch.bool)), persistent=False
        )

    def _attn(self, query, key, value):
        # query, key, value: (batch, heads, seq, head_dim)
        scale_factor = 1 / math.sqrt(self.head_dim) if self.scale_attn_weights else 1.0
        attn_weights = torch.matmul(query, key.transpose(-1, -2)) * scale_factor
        q_len, k_len = query.size(-2), key.size(-2)
        causal_mask = self.bias[k_len - q_len : k_len, :k_len]
        mask_value = torch.finfo(attn_weights.dtype).min
        attn_weights = torch.where(
            causal_mask, attn_weights, torch.full_like(attn_weights, mask_value)
        )
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_weights = F.dropout(attn_weights, self.attn_pdrop, training=self.training)
        return torch.matmul(attn_weights, value), attn_weights

    def forward(self, hidden_states):
        b, t, _ = hidden_states.shape
        query, key, value = self.c_attn(hidden_states).split(self.embed_dim, dim=2)
        query = query.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        key = key.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        value = value.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        attn_output, attn_weights = self._attn(query, key, value)
        attn_output = attn_output.transpose(1, 2).reshape(b, t, self.embed_dim)
        attn_output = self.c_proj(attn_output)
        attn_output = F.dropout(attn_output, self.resid_pdrop)
        return attn_output, attn_weights


def make_attention():
    config = SimpleNamespace(
        hidden_size=24,
        num_attention_heads=4,
        multi_query=False,
        scale_attn_weights=True,
        attn_pdrop=0.1,
        resid_pdrop=0.1,
        max_position_embeddings=64,
    )
    return GPTBigCodeAttention(config)


EXPECT = {
    "target": "make_attention",
    "kind": "causal-multihead",
    "ok": False,
    "stage": "output",
    "mistake": "other",
    "style": "GPT-BigCode attention (c_attn/c_proj, bool tril buffer; F.dropout on the output left on in eval)",
}

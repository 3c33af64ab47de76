"""Bark (suno-ai / HF BarkSelfAttention), causal semantic/coarse model block.

Fused att_proj Linear(d, 3d) split into q, k, v with .split(embed_dim, dim=2); _split_heads
view + permute; a boolean tril `bias` buffer of block_size; masked_fill(finfo.min) on the
scaled scores; _merge_heads via transpose + view; out_proj. 6 heads of 8, d = 48.
"""

import math

import torch
from torch import nn


class BarkSelfAttention(nn.Module):
    def __init__(self, hidden_size=48, num_heads=6, block_size=128, bias=True, is_causal=True):
        super().__init__()
        self.embed_dim = hidden_size
        self.num_heads = num_heads
        self.head_dim = self.embed_dim // self.num_heads
        self.att_proj = nn.Linear(self.embed_dim, 3 * self.embed_dim, bias=bias)
        self.out_proj = nn.Linear(self.embed_dim, self.embed_dim, bias=bias)
        self.is_causal = is_causal
        if is_causal:
            block = torch.ones((block_size, block_size), dtype=torch.bool)
            self.register_buffer(
                "bias", torch.tril(block).view(1, 1, block_size, block_size), persistent=False
            )

    def _split_heads(self, tensor, num_heads, attn_head_size):
        new_shape = tensor.size()[:-1] + (num_heads, attn_head_size)
        tensor = tensor.view(new_shape)
        return tensor.permute(0, 2, 1, 3)

    def _merge_heads(self, tensor, num_heads, attn_head_size):
        tensor = tensor.transpose(1, 2).contiguous()
        tensor = tensor.view(tensor.size()[:-2] + (num_heads * attn_head_size,))
        return tensor

    def _attn(self, query, key, value, attention_mask=None):
        attn_weights = torch.matmul(query, key.transpose(-1, -2)) * (1.0 / math.sqrt(self.head_dim))
        if self.is_causal:
            query_length, key_length = query.size(-2), key.size(-2)
            attn_weights = attn_weights.masked_fill(
                self.bias[:, :, key_length - query_length : key_length, :key_length] == 0,
                torch.finfo(attn_weights.dtype).min,
            )
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_weights = attn_weights.to(value.dtype)
        return torch.matmul(attn_weights, value), attn_weights

    def forward(self, hidden_states, attention_mask=None):
        query, key, value = self.att_proj(hidden_states).split(self.embed_dim, dim=2)
        query = self._split_heads(query, self.num_heads, self.head_dim)
        key = self._split_heads(key, self.num_heads, self.head_dim)
        value = self._split_heads(value, self.num_heads, self.head_dim)
        attn_output, attn_weights = self._attn(query, key, value, attention_mask)
        attn_output = self._merge_heads(attn_output, self.num_heads, self.head_dim)
        attn_output = self.out_proj(attn_output)
        return attn_output, attn_weights


class BarkLayerNorm(nn.Module):
    def __init__(self, hidden_size, bias=True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size)) if bias else None

    def forward(self, x):
        return nn.functional.layer_norm(x, self.weight.shape, self.weight, self.bias, eps=1e-5)


class BarkBlock(nn.Module):
    def __init__(self, hidden_size=48):
        super().__init__()
        self.layernorm_1 = BarkLayerNorm(hidden_size)
        self.attn = BarkSelfAttention(hidden_size)
        self.layernorm_2 = BarkLayerNorm(hidden_size)
        self.mlp = nn.Sequential(
            nn.Linear(hidden_size, 4 * hidden_size),
            nn.GELU(),
            nn.Linear(4 * hidden_size, hidden_size),
        )

    def forward(self, hidden_states):
        attn_out = self.attn(self.layernorm_1(hidden_states))[0]
        hidden_states = hidden_states + attn_out
        return hidden_states + self.mlp(self.layernorm_2(hidden_states))


def make_bark_block():
    torch.manual_seed(110)
    blk = BarkBlock()
    with torch.no_grad():
        for ln in (blk.layernorm_1, blk.layernorm_2):
            ln.weight.uniform_(0.5, 1.5)
            ln.bias.uniform_(-0.1, 0.1)
    return blk.eval()


EXPECT = {
    "target": "make_bark_block",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "attn",
    "structure": {
        "heads": 6,
        "kv_heads": 6,
        "head_dim": 8,
        "causal": True,
        "cross": False,
        "rope": None,
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "HF Bark BarkSelfAttention (fused att_proj split(embed_dim, dim=2), _split_heads/_merge_heads, boolean "
    "tril `bias` buffer with finfo.min fill) in a BarkBlock",
}

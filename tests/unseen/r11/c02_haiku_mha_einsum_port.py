"""A PyTorch port of dm-haiku's hk.MultiHeadAttention as used by the haiku transformer example:
separate query/key/value linears to (..., T, H, key_size), einsum '...thd,...Thd->...htT',
logits / sqrt(key_size), a causal np.tril mask filled with -1e30, einsum '...htT,...Thd->...thd',
reshape to (..., T, H * value_size) and a final linear. Pre-LayerNorm decoder block."""

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


class MultiHeadAttention(nn.Module):
    def __init__(self, num_heads, key_size, model_size):
        super().__init__()
        self.num_heads = num_heads
        self.key_size = key_size
        self.value_size = key_size
        self.model_size = model_size
        self.query = nn.Linear(model_size, num_heads * key_size)
        self.key = nn.Linear(model_size, num_heads * key_size)
        self.value = nn.Linear(model_size, num_heads * self.value_size)
        self.linear = nn.Linear(num_heads * self.value_size, model_size)

    def _linear_projection(self, layer, x, head_size):
        y = layer(x)
        *leading_dims, _ = x.shape
        return y.reshape((*leading_dims, self.num_heads, head_size))

    def forward(self, query, key, value, mask=None):
        query_heads = self._linear_projection(self.query, query, self.key_size)
        key_heads = self._linear_projection(self.key, key, self.key_size)
        value_heads = self._linear_projection(self.value, value, self.value_size)
        attn_logits = torch.einsum("...thd,...Thd->...htT", query_heads, key_heads)
        attn_logits = attn_logits / np.sqrt(self.key_size).astype(np.float32).item()
        if mask is not None:
            attn_logits = torch.where(mask, attn_logits, torch.full_like(attn_logits, -1e30))
        attn_weights = F.softmax(attn_logits, dim=-1)
        attn = torch.einsum("...htT,...Thd->...thd", attn_weights, value_heads)
        attn = attn.reshape((*query.shape[:-1], -1))
        return self.linear(attn)


class DecoderBlock(nn.Module):
    def __init__(self, num_heads=4, key_size=16, model_size=64):
        super().__init__()
        self.ln = nn.LayerNorm(model_size)
        self.attn = MultiHeadAttention(num_heads, key_size, model_size)

    def forward(self, h):
        seq_len = h.shape[1]
        causal_mask = torch.from_numpy(np.tril(np.ones((1, 1, seq_len, seq_len), dtype=bool)))
        h_norm = self.ln(h)
        return h + self.attn(h_norm, h_norm, h_norm, mask=causal_mask)


def make_haiku_block():
    torch.manual_seed(1102)
    block = DecoderBlock()
    with torch.no_grad():
        block.ln.weight.uniform_(0.5, 1.5)
        block.ln.bias.uniform_(-0.2, 0.2)
    return block.eval()


EXPECT = {
    "target": "make_haiku_block",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "attn",
    "structure": {
        "heads": 4,
        "kv_heads": 4,
        "head_dim": 16,
        "causal": True,
        "cross": False,
        "rope": None,
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "dm-haiku hk.MultiHeadAttention ported to torch: per-projection reshape to (..., T, H, "
    "key_size), einsum '...thd,...Thd->...htT', / sqrt(key_size), np.tril causal mask with "
    "-1e30 via where, einsum '...htT,...Thd->...thd'; pre-LN decoder block",
}

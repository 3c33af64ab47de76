"""Torch port of a MaxText-style decoder attention: separate query/key/value kernels,
timescale-form rotary on halves (min_timescale 1, max_timescale 10000), query
scaled by depth**-0.5 before the einsum, GQA 4 query heads over 2 kv heads.  The port
rotates the queries at decoder_positions (0..n-1) but derives the key positions from
the segment ids with a cumsum and forgets the -1, so keys sit one position ahead.
"""

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    def __init__(self, embedding_dims, min_timescale=1, max_timescale=10_000):
        super().__init__()
        self.embedding_dims, self.min_timescale, self.max_timescale = (
            embedding_dims,
            min_timescale,
            max_timescale,
        )

    def forward(self, inputs, position):
        half = self.embedding_dims // 2
        fraction = 2 * torch.arange(0, half, dtype=torch.float64) / self.embedding_dims
        timescale = self.min_timescale * (self.max_timescale / self.min_timescale) ** fraction
        sinusoid_inp = position[:, :, None, None].double() / timescale  # (b, t, 1, half)
        sin, cos = (
            torch.sin(sinusoid_inp).to(inputs.dtype),
            torch.cos(sinusoid_inp).to(inputs.dtype),
        )
        first_half, second_half = torch.split(inputs, half, dim=-1)
        first_part = first_half * cos - second_half * sin
        second_part = second_half * cos + first_half * sin
        return torch.cat([first_part, second_part], dim=-1)


class Attention(nn.Module):
    def __init__(self, emb_dim=64, num_query_heads=4, num_kv_heads=2, head_dim=16):
        super().__init__()
        self.nq, self.nkv, self.head_dim = num_query_heads, num_kv_heads, head_dim
        self.query = nn.Linear(emb_dim, num_query_heads * head_dim, bias=False)
        self.key = nn.Linear(emb_dim, num_kv_heads * head_dim, bias=False)
        self.value = nn.Linear(emb_dim, num_kv_heads * head_dim, bias=False)
        self.out = nn.Linear(num_query_heads * head_dim, emb_dim, bias=False)
        self.rotary = RotaryEmbedding(head_dim)

    def forward(self, inputs_q, decoder_segment_ids, decoder_positions):
        b, t, _ = inputs_q.shape
        query = self.query(inputs_q).view(b, t, self.nq, self.head_dim)
        key = self.key(inputs_q).view(b, t, self.nkv, self.head_dim)
        value = self.value(inputs_q).view(b, t, self.nkv, self.head_dim)
        key_positions = torch.cumsum((decoder_segment_ids != 0).long(), dim=-1)
        query = self.rotary(query, decoder_positions)
        key = self.rotary(key, key_positions)
        query = query / (self.head_dim**0.5)
        query = query.view(b, t, self.nkv, self.nq // self.nkv, self.head_dim)
        attn_weights = torch.einsum("btkgd,bskd->bkgts", query, key)
        causal = (
            decoder_positions[:, None, None, :, None] >= decoder_positions[:, None, None, None, :]
        )
        attn_weights = torch.where(
            causal,
            attn_weights,
            torch.tensor(-0.7 * torch.finfo(attn_weights.dtype).max, dtype=attn_weights.dtype),
        )
        probs = torch.softmax(attn_weights, dim=-1)
        out = torch.einsum("bkgts,bskd->btkgd", probs, value).reshape(b, t, -1)
        return self.out(out)


class DecoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre_self_attention_norm = nn.RMSNorm(64, eps=1e-6)
        self.self_attention = Attention()

    def forward(self, inputs):
        b, t, _ = inputs.shape
        decoder_segment_ids = torch.ones(b, t, dtype=torch.long)
        decoder_positions = torch.arange(t)[None].expand(b, t)
        return inputs + self.self_attention(
            self.pre_self_attention_norm(inputs), decoder_segment_ids, decoder_positions
        )


def make_maxtext_layer():
    torch.manual_seed(106)
    layer = DecoderLayer()
    with torch.no_grad():
        layer.pre_self_attention_norm.weight.uniform_(0.5, 1.5)
    return layer


EXPECT = {
    "target": "make_maxtext_layer",
    "kind": "causal-multihead",
    "ok": False,
    "layer": "self_attention",
    "stage": "rotated_keys",
    "mistake": "rope_positions",
    "style": "torch port of MaxText Attention (GQA 4:2 grouped einsum, timescale rotary on halves, base 10000): "
    "key positions = cumsum(segment_ids != 0) without -1, one position ahead of the queries' 0..n-1",
}

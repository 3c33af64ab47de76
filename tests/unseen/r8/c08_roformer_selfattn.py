"""RoFormer style encoder self-attention: BERT layout (query/key/value Linear with bias,
no output projection inside the self-attention module: it lives in RoFormerSelfOutput),
sinusoidal table built by the encoder and applied with interleaved (adjacent) pairs.
"""

import math

import torch
from torch import nn


class RoFormerSinusoidalPositionalEmbedding(nn.Module):
    def __init__(self, num_positions, dim):
        super().__init__()
        pos = torch.arange(num_positions, dtype=torch.float64)[:, None]
        j = torch.arange(dim // 2, dtype=torch.float64)[None, :]
        ang = pos / torch.pow(10000.0, 2 * j / dim)
        table = torch.cat([torch.sin(ang), torch.cos(ang)], dim=-1)
        self.register_buffer("weight", table.float(), persistent=False)

    def forward(self, seq_len, past=0):
        return self.weight[past : past + seq_len]


class RoFormerSelfAttention(nn.Module):
    def __init__(self, hidden=64, heads=4):
        super().__init__()
        self.num_attention_heads = heads
        self.attention_head_size = hidden // heads
        self.all_head_size = hidden
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)

    def transpose_for_scores(self, x):
        return x.view(x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)).permute(
            0, 2, 1, 3
        )

    @staticmethod
    def apply_rotary_position_embeddings(sinusoidal_pos, query_layer, key_layer):
        sin, cos = sinusoidal_pos.chunk(2, dim=-1)
        sin_pos = torch.stack([sin, sin], dim=-1).reshape_as(sinusoidal_pos)
        cos_pos = torch.stack([cos, cos], dim=-1).reshape_as(sinusoidal_pos)
        rq = torch.stack([-query_layer[..., 1::2], query_layer[..., ::2]], dim=-1).reshape_as(
            query_layer
        )
        rk = torch.stack([-key_layer[..., 1::2], key_layer[..., ::2]], dim=-1).reshape_as(key_layer)
        return query_layer * cos_pos + rq * sin_pos, key_layer * cos_pos + rk * sin_pos

    def forward(self, hidden_states, attention_mask=None, sinusoidal_pos=None):
        q = self.transpose_for_scores(self.query(hidden_states))
        k = self.transpose_for_scores(self.key(hidden_states))
        v = self.transpose_for_scores(self.value(hidden_states))
        q, k = self.apply_rotary_position_embeddings(sinusoidal_pos.to(q.dtype), q, k)
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.attention_head_size)
        if attention_mask is not None:
            scores = scores + attention_mask
        probs = nn.functional.softmax(scores, dim=-1)
        ctx = torch.matmul(probs, v).permute(0, 2, 1, 3).contiguous()
        return (ctx.view(ctx.size()[:-2] + (self.all_head_size,)),)


class RoFormerSelfOutput(nn.Module):
    def __init__(self, hidden=64):
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=1e-12)

    def forward(self, h, inp):
        return self.LayerNorm(self.dense(h) + inp)


class RoFormerAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_positions = RoFormerSinusoidalPositionalEmbedding(512, 16)
        self.self = RoFormerSelfAttention()
        self.output = RoFormerSelfOutput()

    def forward(self, hidden_states):
        t = hidden_states.shape[1]
        sinusoidal_pos = self.embed_positions(t)[None, None, :, :]
        return self.output(self.self(hidden_states, None, sinusoidal_pos)[0], hidden_states)


def make_roformer_attention():
    torch.manual_seed(8)
    return RoFormerAttention()


EXPECT = {
    "target": "make_roformer_attention",
    "kind": "multihead",
    "ok": True,
    "layer": "self",
    "structure": {
        "heads": 4,
        "kv_heads": 4,
        "head_dim": 16,
        "causal": False,
        "cross": False,
        "rope": {"pairing": "interleaved", "fraction": 1.0, "base": 10000},
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "HF RoFormer: BERT-style self-attention without its own output projection (dense lives in "
    "RoFormerSelfOutput), sinusoidal [sin|cos] table stacked to adjacent pairs, non-causal encoder",
}

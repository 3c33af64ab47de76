"""DataDog Toto time-wise attention (in the manner of DataDog/toto toto/model/attention.py and
toto/model/rope.py): one fused bias-free wQKV projection cut into (q, k, v) and heads, a
TimeAwareRotaryEmbedding in the style of rotary-embedding-torch (interleaved feature pairs (2i,
2i+1), repeat_interleave'd frequencies, only the first rotary_dim features of each head rotated),
causal over the time axis, scaled_dot_product_attention or an eager path, wO output projection,
pre-RMSNorm block with a SwiGLU MLP.

This file: one bug: the query offset is computed as k_len - 1 (as if every call decoded one
token): queries rotated at n-1..2n-2, keys at 0..n-1."""

import math

import torch
import torch.nn.functional as F
from torch import nn


class TotoConfig:
    embed_dim = 64
    num_heads = 4
    rotary_dim = 16
    rope_theta = 10000.0
    use_sdpa = True
    mlp_hidden_dim = 128
    eps = 1e-6


class AttentionAxis:
    TIME = 1
    SPACE = 2


class TotoRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.scale


def rotate_pairs(x):
    pairs = x.unflatten(-1, (-1, 2))
    x1, x2 = pairs.unbind(-1)
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


class TimeAwareRotaryEmbedding(nn.Module):
    def __init__(self, dim, theta):
        super().__init__()
        self.dim = dim
        freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        self.register_buffer("freqs", freqs, persistent=False)

    def tables(self, seq_len, offset, dtype):
        t = torch.arange(seq_len, dtype=torch.float64) + offset
        angles = torch.einsum("i,j->ij", t, self.freqs).repeat_interleave(2, dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def rotate_queries_or_keys(self, x, offset=0):
        cos, sin = self.tables(x.shape[-2], offset, x.dtype)
        x_rot, x_pass = x[..., : self.dim], x[..., self.dim :]
        x_rot = x_rot * cos + rotate_pairs(x_rot) * sin
        return torch.cat((x_rot, x_pass), dim=-1)


class TimeWiseMultiheadAttention(nn.Module):
    def __init__(self, config, attention_axis=AttentionAxis.TIME):
        super().__init__()
        self.embed_dim = config.embed_dim
        self.num_heads = config.num_heads
        self.head_dim = config.embed_dim // config.num_heads
        self.attention_axis = attention_axis
        self.is_causal = self.attention_axis == AttentionAxis.TIME
        self.use_sdpa = config.use_sdpa
        self.wQKV = nn.Linear(self.embed_dim, 3 * self.embed_dim, bias=False)
        self.wO = nn.Linear(self.embed_dim, self.embed_dim, bias=False)
        self.rotary_emb = TimeAwareRotaryEmbedding(config.rotary_dim, config.rope_theta)

    def forward(self, inputs):
        batch, seq_len, _ = inputs.shape
        qkv = self.wQKV(inputs).view(batch, seq_len, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        q = self.rotary_emb.rotate_queries_or_keys(q, offset=k.shape[-2] - 1)
        k = self.rotary_emb.rotate_queries_or_keys(k)
        if self.use_sdpa:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=self.is_causal)
        else:
            scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.head_dim)
            if self.is_causal:
                future = torch.ones(seq_len, seq_len, dtype=torch.bool).triu(1)
                scores = scores.masked_fill(future, float("-inf"))
            weights = torch.softmax(scores, dim=-1)
            out = torch.matmul(weights, v)
        out = out.transpose(1, 2).reshape(batch, seq_len, self.embed_dim)
        return self.wO(out)


class SwiGLU(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.w12 = nn.Linear(config.embed_dim, 2 * config.mlp_hidden_dim, bias=False)
        self.w3 = nn.Linear(config.mlp_hidden_dim, config.embed_dim, bias=False)

    def forward(self, x):
        a, b = self.w12(x).chunk(2, dim=-1)
        return self.w3(F.silu(a) * b)


class TotoTransformerLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.norm1 = TotoRMSNorm(config.embed_dim, config.eps)
        self.attention = TimeWiseMultiheadAttention(config)
        self.norm2 = TotoRMSNorm(config.embed_dim, config.eps)
        self.mlp = SwiGLU(config)

    def forward(self, x):
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TotoTransformer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList([TotoTransformerLayer(config)])
        self.norm = TotoRMSNorm(config.embed_dim, config.eps)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


def make_toto_model():
    torch.manual_seed(3612)
    model = TotoTransformer(TotoConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, TotoRMSNorm):
                mod.scale.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {
    "target": "make_toto_model",
    "kind": "causal-multihead",
    "ok": False,
    "layer": "layers.0.attention",
    "stage": "rotated_queries",
    "mistake": "rope_positions",
    "style": "DataDog Toto TimeWiseMultiheadAttention: one bug: query rotary offset "
    "k.shape[-2] - 1 instead of k_len - q_len: queries n-1 positions ahead of "
    "keys",
}

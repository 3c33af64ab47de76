"""tiny-llm style (skyzh/tiny-llm, the "LLM serving in a week" course, week 1 Qwen2) ported from MLX
to torch: Qwen2MultiHeadAttention with wq/wk/wv (+ bias) and wo, a RoPE(dims, seq_len, base,
traditional=False) module whose __call__ takes (x[B, L, H, D], offset slice), the grouped
scaled_dot_product_attention_grouped that reshapes queries to (B, H_kv, n_repeats, L, D) and keys to
(B, H_kv, 1, S, D), and causal_mask(L, S) = triu(-inf, k=S-L+1) for mask="causal".

This file: one bug: wq output reshaped as (B, H, L, D) then transposed, cutting query heads across tokens"""

import math

import torch
from torch import nn


class RoPE(nn.Module):
    def __init__(self, dims, seq_len, base=10000.0, traditional=False):
        super().__init__()
        self.dims = dims
        self.traditional = traditional
        inner = torch.arange(0, dims // 2, dtype=torch.float64) / (dims // 2)
        freqs = torch.outer(torch.arange(seq_len, dtype=torch.float64), 1.0 / base**inner)
        self.register_buffer("cos_freqs", freqs.cos(), persistent=False)
        self.register_buffer("sin_freqs", freqs.sin(), persistent=False)

    def forward(self, x, offset=None):
        N, L, H, D = x.shape
        sl = offset if offset is not None else slice(0, L)
        cos = self.cos_freqs[sl].to(x.dtype)[None, :, None, :]
        sin = self.sin_freqs[sl].to(x.dtype)[None, :, None, :]
        x1, x2 = x[..., : D // 2], x[..., D // 2 :]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def causal_mask(L, S, dtype):
    return torch.triu(torch.full((L, S), float("-inf"), dtype=dtype), diagonal=S - L + 1)


def scaled_dot_product_attention_grouped(query, key, value, scale=None, mask=None):
    factor = scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])
    *B, H_q, L, D = query.shape
    H, S = key.shape[-3], key.shape[-2]
    n_repeats = H_q // H
    query = query.reshape(*B, H, n_repeats, L, D)
    key = key.reshape(*B, H, 1, S, D)
    value = value.reshape(*B, H, 1, S, D)
    scores = torch.matmul(query, key.transpose(-1, -2)) * factor
    if mask is not None:
        if isinstance(mask, str) and mask == "causal":
            mask = causal_mask(L, S, scores.dtype).to(scores.device)
        scores = scores + mask.reshape(*([1] * (scores.dim() - 2)), L, S)
    scores = torch.softmax(scores, dim=-1)
    return torch.matmul(scores, value).reshape(*B, H_q, L, D)


class Qwen2MultiHeadAttention(nn.Module):
    def __init__(self, hidden_size=64, num_heads=4, num_kv_heads=2, max_seq_len=128, theta=1000000.0):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = hidden_size // num_heads
        self.wq = nn.Linear(hidden_size, num_heads * self.head_dim, bias=True)
        self.wk = nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=True)
        self.wv = nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=True)
        self.wo = nn.Linear(num_heads * self.head_dim, hidden_size, bias=False)
        self.rope = RoPE(self.head_dim, max_seq_len, theta)

    def forward(self, x, offset=0, mask=None):
        B, L, _ = x.shape
        projection_q = self.wq(x).reshape(B, self.num_heads, L, self.head_dim).transpose(1, 2)
        projection_k = self.wk(x).reshape(B, L, self.num_kv_heads, self.head_dim)
        projection_v = self.wv(x).reshape(B, L, self.num_kv_heads, self.head_dim)
        projection_q = self.rope(projection_q, offset=slice(offset, offset + L))
        projection_k = self.rope(projection_k, offset=slice(offset, offset + L))
        projection_q = projection_q.transpose(1, 2)
        projection_k = projection_k.transpose(1, 2)
        projection_v = projection_v.transpose(1, 2)
        x = scaled_dot_product_attention_grouped(
            projection_q, projection_k, projection_v, scale=1.0 / math.sqrt(self.head_dim), mask=mask
        )
        x = x.transpose(1, 2).reshape(B, L, self.num_heads * self.head_dim)
        return self.wo(x)


class Qwen2RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class Qwen2TransformerBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm = Qwen2RMSNorm(64)
        self.self_attn = Qwen2MultiHeadAttention()

    def forward(self, x, offset=0, mask="causal"):
        return x + self.self_attn(self.input_layernorm(x), offset, mask)


def make_tinyllm_qwen2():
    torch.manual_seed(2063)
    block = Qwen2TransformerBlock()
    with torch.no_grad():
        block.input_layernorm.weight.uniform_(0.5, 1.5)
    return block.eval()


EXPECT = {'target': 'make_tinyllm_qwen2',
 'kind': 'causal-multihead',
 'ok': False,
 'layer': 'self_attn',
 'stage': 'queries',
 'mistake': 'heads_split',
 'style': 'skyzh tiny-llm week-1 Qwen2MultiHeadAttention: one bug: wq output reshaped as (B, H, L, '
          'D) then transposed, cutting query heads across tokens'}

"""LlamaGen (FoundationVision `autoregressive/models/gpt.py`) Attention: fused `wqkv` split by
[dim, kv_size, kv_size], (bs, seq, head, dim) views, `apply_rotary_emb` on the stacked (cos, sin)
`freqs_cis` (adjacent pairs) from `precompute_freqs_cis(..., cls_token_num)`, transpose,
`repeat_interleave` GQA (`n_kv_head`), SDPA with `is_causal=True if mask is None`, `wo` +
`resid_dropout`; `TransformerBlock` with attention_norm / ffn_norm and drop_path.

This file: export math path with no 1/sqrt(head_dim) on the scores."""

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ModelArgs:
    dim: int = 64
    n_layer: int = 1
    n_head: int = 4
    n_kv_head: Optional[int] = 2
    multiple_of: int = 32
    ffn_dim_multiplier: Optional[float] = None
    rope_base: float = 10000
    norm_eps: float = 1e-5
    attn_dropout_p: float = 0.0
    resid_dropout_p: float = 0.1
    ffn_dropout_p: float = 0.1
    block_size: int = 64  # image tokens (an 8 x 8 grid)
    cls_token_num: int = 0
    rope_2d: bool = False


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + self.eps)

    def forward(self, x):
        return self._norm(x) * self.weight


class FeedForward(nn.Module):
    def __init__(self, config: ModelArgs):
        super().__init__()
        hidden_dim = int(2 * (4 * config.dim) / 3)
        hidden_dim = config.multiple_of * ((hidden_dim + config.multiple_of - 1) // config.multiple_of)
        self.w1 = nn.Linear(config.dim, hidden_dim, bias=False)
        self.w3 = nn.Linear(config.dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, config.dim, bias=False)
        self.ffn_dropout = nn.Dropout(config.ffn_dropout_p)

    def forward(self, x):
        return self.ffn_dropout(self.w2(F.silu(self.w1(x)) * self.w3(x)))


class Attention(nn.Module):
    def __init__(self, config: ModelArgs):
        super().__init__()
        assert config.dim % config.n_head == 0
        self.dim = config.dim
        self.head_dim = config.dim // config.n_head
        self.n_head = config.n_head
        self.n_kv_head = config.n_kv_head if config.n_kv_head is not None else config.n_head
        total_kv_dim = (self.n_head + 2 * self.n_kv_head) * self.head_dim

        # key, query, value projections for all heads, but in a batch
        self.wqkv = nn.Linear(config.dim, total_kv_dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)
        self.kv_cache = None

        # regularization
        self.attn_dropout_p = config.attn_dropout_p
        self.resid_dropout = nn.Dropout(config.resid_dropout_p)

    def forward(self, x, freqs_cis=None, input_pos=None, mask=None):
        bsz, seqlen, _ = x.shape
        kv_size = self.n_kv_head * self.head_dim
        xq, xk, xv = self.wqkv(x).split([self.dim, kv_size, kv_size], dim=-1)

        xq = xq.view(bsz, seqlen, self.n_head, self.head_dim)
        xk = xk.view(bsz, seqlen, self.n_kv_head, self.head_dim)
        xv = xv.view(bsz, seqlen, self.n_kv_head, self.head_dim)

        xq = apply_rotary_emb(xq, freqs_cis)
        xk = apply_rotary_emb(xk, freqs_cis)

        xq, xk, xv = map(lambda t: t.transpose(1, 2), (xq, xk, xv))

        if self.kv_cache is not None:
            keys, values = self.kv_cache.update(input_pos, xk, xv)
        else:
            keys, values = xk, xv
        keys = keys.repeat_interleave(self.n_head // self.n_kv_head, dim=1)
        values = values.repeat_interleave(self.n_head // self.n_kv_head, dim=1)

        # export-friendly math attention (no fused SDPA op in the target runtime)
        attn = torch.matmul(xq, keys.transpose(-2, -1))
        if mask is None:
            future = torch.ones(seqlen, seqlen, dtype=torch.bool, device=x.device).triu(1)
            attn = attn.masked_fill(future, float("-inf"))
        else:
            attn = attn.masked_fill(~mask, float("-inf"))
        output = torch.matmul(torch.softmax(attn, dim=-1), values)

        output = output.transpose(1, 2).contiguous().view(bsz, seqlen, self.dim)

        output = self.resid_dropout(self.wo(output))
        return output


class TransformerBlock(nn.Module):
    def __init__(self, config: ModelArgs, drop_path: float = 0.0):
        super().__init__()
        self.attention = Attention(config)
        self.feed_forward = FeedForward(config)
        self.attention_norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.ffn_norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.drop_path = nn.Identity()

    def forward(self, x, freqs_cis, start_pos=None, mask=None):
        h = x + self.drop_path(self.attention(self.attention_norm(x), freqs_cis, start_pos, mask))
        return h + self.drop_path(self.feed_forward(self.ffn_norm(h)))


def precompute_freqs_cis(seq_len: int, n_elem: int, base: int = 10000, cls_token_num=120):
    freqs = 1.0 / (base ** (torch.arange(0, n_elem, 2, dtype=torch.float64)[: (n_elem // 2)] / n_elem))
    t = torch.arange(seq_len, dtype=torch.float64)
    freqs = torch.outer(t, freqs)  # (seq_len, head_dim // 2)
    freqs_cis = torch.polar(torch.ones_like(freqs), freqs)
    cache = torch.stack([freqs_cis.real, freqs_cis.imag], dim=-1)  # (seq_len, head_dim // 2, 2)
    cond_cache = torch.cat([torch.zeros(cls_token_num, n_elem // 2, 2, dtype=torch.float64), cache])
    return cond_cache


def precompute_freqs_cis_2d(grid_size: int, n_elem: int, base: int = 10000, cls_token_num=120):
    # split the dimension into half, one for x and one for y
    half_dim = n_elem // 2
    freqs = 1.0 / (base ** (torch.arange(0, half_dim, 2, dtype=torch.float64)[: (half_dim // 2)] / half_dim))
    t = torch.arange(grid_size, dtype=torch.float64)
    freqs = torch.outer(t, freqs)  # (grid_size, head_dim // 4)
    freqs_grid = torch.cat(
        [freqs[:, None, :].expand(-1, grid_size, -1), freqs[None, :, :].expand(grid_size, -1, -1)],
        dim=-1,
    )  # (grid_size, grid_size, head_dim // 2)
    cache_grid = torch.stack([torch.cos(freqs_grid), torch.sin(freqs_grid)], dim=-1)
    cache = cache_grid.flatten(0, 1)
    cond_cache = torch.cat([torch.zeros(cls_token_num, n_elem // 2, 2, dtype=torch.float64), cache])
    return cond_cache


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor):
    # x: (bs, seq_len, n_head, head_dim); freqs_cis: (seq_len, head_dim // 2, 2)
    xshaped = x.reshape(*x.shape[:-1], -1, 2)
    freqs_cis = freqs_cis.to(x.dtype).view(1, xshaped.size(1), 1, xshaped.size(3), 2)
    x_out2 = torch.stack(
        [
            xshaped[..., 0] * freqs_cis[..., 0] - xshaped[..., 1] * freqs_cis[..., 1],
            xshaped[..., 1] * freqs_cis[..., 0] + xshaped[..., 0] * freqs_cis[..., 1],
        ],
        dim=-1,
    )
    return x_out2.flatten(3).type_as(x)


class Transformer(nn.Module):
    """LlamaGen GPT body over already-embedded image tokens (training-time forward, no kv cache)."""

    def __init__(self, config: ModelArgs):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.dim, eps=config.norm_eps)
        head_dim = config.dim // config.n_head
        if config.rope_2d:
            grid_size = int(config.block_size ** 0.5)
            assert grid_size * grid_size == config.block_size
            freqs_cis = precompute_freqs_cis_2d(grid_size, head_dim, config.rope_base, config.cls_token_num)
        else:
            freqs_cis = precompute_freqs_cis(config.block_size, head_dim, config.rope_base, config.cls_token_num)
        self.register_buffer("freqs_cis", freqs_cis, persistent=False)

    def forward(self, token_embeddings):
        seqlen = token_embeddings.shape[1]
        freqs_cis = self.freqs_cis[:seqlen]
        h = token_embeddings
        for layer in self.layers:
            h = layer(h, freqs_cis, start_pos=None, mask=None)
        return self.norm(h)


def make_llamagen_gpt():
    torch.manual_seed(2962)
    model = Transformer(ModelArgs())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, RMSNorm):
                mod.weight.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {'target': 'make_llamagen_gpt',
 'kind': 'causal-multihead',
 'ok': False,
 'layer': 'layers.0.attention',
 'stage': 'scaled_scores',
 'mistake': 'missing_scale',
 'style': 'LlamaGen Attention (autoregressive/models/gpt.py): export math path with no '
          '1/sqrt(head_dim) on the scores'}

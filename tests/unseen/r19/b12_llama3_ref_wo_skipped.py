"""meta-llama/llama-models reference Llama 3 `Attention` (models/llama3/model.py) in plain torch:
`wq`/`wk`/`wv`/`wo` (fairscale Column/RowParallelLinear replaced by nn.Linear, model-parallel size 1),
`precompute_freqs_cis` with Llama 3.1's `apply_scaling` (use_scaled_rope: scale_factor 8,
low/high_freq_factor 1/4, old_context_len 8192), `torch.polar` table held by the `Transformer` as a plain attribute and sliced
`[start_pos : start_pos + seqlen]`, `apply_rotary_emb` by `view_as_complex` over consecutive pairs,
`repeat_kv` by expand/reshape on the (bs, slen, n_kv_heads, head_dim) layout, and the model's
`triu(full(-inf), 1)` mask `hstack`ed after zeros for the cached positions.

This file: one bug: the layer has wo but returns the merged heads without it."""

import math

import torch
from torch import nn


class ModelArgs:
    dim = 64
    n_heads = 4
    n_kv_heads = 2
    rope_theta = 500000.0
    use_scaled_rope = True
    max_seq_len = 64


def apply_scaling(freqs):
    scale_factor = 8
    low_freq_factor = 1
    high_freq_factor = 4
    old_context_len = 8192
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    new_freqs = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            new_freqs.append(freq)
        elif wavelen > low_freq_wavelen:
            new_freqs.append(freq / scale_factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            new_freqs.append((1 - smooth) * freq / scale_factor + smooth * freq)
    return torch.tensor(new_freqs, dtype=freqs.dtype)


def precompute_freqs_cis(dim, end, theta=10000.0, use_scaled=False):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].double() / dim))
    t = torch.arange(end, dtype=torch.float64)
    if use_scaled:
        freqs = apply_scaling(freqs)
    freqs = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(freqs), freqs)  # complex128


def reshape_for_broadcast(freqs_cis, x):
    ndim = x.ndim
    assert freqs_cis.shape == (x.shape[1], x.shape[-1])
    shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.view(*shape)


def apply_rotary_emb(x, freqs_cis):
    x_ = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2))
    freqs_cis = reshape_for_broadcast(freqs_cis, x_)
    x_out = torch.view_as_real(x_ * freqs_cis).flatten(3)
    return x_out.type_as(x)


def repeat_kv(x, n_rep):
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return (
        x[:, :, :, None, :]
        .expand(bs, slen, n_kv_heads, n_rep, head_dim)
        .reshape(bs, slen, n_kv_heads * n_rep, head_dim)
    )


class Attention(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.n_kv_heads = args.n_heads if args.n_kv_heads is None else args.n_kv_heads
        self.n_local_heads = args.n_heads
        self.n_local_kv_heads = self.n_kv_heads
        self.n_rep = self.n_local_heads // self.n_local_kv_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x, start_pos, freqs_cis, mask):
        bsz, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        xk = xk.view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
        xv = xv.view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)

        xq = apply_rotary_emb(xq, freqs_cis=freqs_cis)
        xk = apply_rotary_emb(xk, freqs_cis=freqs_cis)

        # no kv cache kept between calls in this port: keys/values are the current ones
        keys = repeat_kv(xk, self.n_rep)
        values = repeat_kv(xv, self.n_rep)

        xq = xq.transpose(1, 2)
        keys = keys.transpose(1, 2)
        values = values.transpose(1, 2)
        scores = torch.matmul(xq, keys.transpose(2, 3)) / math.sqrt(self.head_dim)
        if mask is not None:
            scores = scores + mask
        scores = torch.softmax(scores, dim=-1)
        output = torch.matmul(scores, values)
        output = output.transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        return output  # wo applied by the (row-parallel) caller


class Transformer(nn.Module):
    """The reference Transformer reduced to what the attention needs: the rotary table and the mask."""

    def __init__(self, params):
        super().__init__()
        self.params = params
        self.attention = Attention(params)
        freqs_cis = precompute_freqs_cis(
            params.dim // params.n_heads,
            params.max_seq_len * 2,
            params.rope_theta,
            params.use_scaled_rope,
        )
        self.freqs_cis = freqs_cis  # plain attribute, as in the reference (complex128, untouched by .float())

    def forward(self, h, start_pos=0):
        _bsz, seqlen, _ = h.shape
        freqs_cis = self.freqs_cis[start_pos : start_pos + seqlen]
        mask = None
        if seqlen > 1:
            mask = torch.full((seqlen, seqlen), float("-inf"), device=h.device)
            mask = torch.triu(mask, diagonal=1)
            mask = torch.hstack([torch.zeros((seqlen, start_pos), device=h.device), mask]).type_as(h)

        return self.attention(h, start_pos, freqs_cis, mask)


def make_llama3_ref():
    torch.manual_seed(1945)
    return Transformer(ModelArgs()).eval()


EXPECT = {'target': 'make_llama3_ref',
 'kind': 'causal-multihead',
 'ok': False,
 'layer': 'attention',
 'stage': 'output',
 'mistake': 'missing_out_proj',
 'style': 'meta-llama/llama-models Llama 3 reference Attention: wo built but the merged heads are '
          'returned'}

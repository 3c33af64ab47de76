"""Penzai's llamalike transformer with Gemma-3-style QK norm (penzai/models/transformer/variants/llamalike_common.py,
`use_qk_norm=True`), ported from JAX.

As penzai builds it: `body.blocks.N.attention` is a `pz.nn.Attention` of five sub-sequentials
(`input_to_query`, `input_to_key`, `input_to_value`, `query_key_to_attn`, `attn_value_to_output`),
named-axis einsums written as einsum letters (GQA as 2 kv heads x 2 query repeats, projection 16),
ApplyRoPE on halves (1e4) from the `token_positions` side input, ConstantRescale(projection^-0.5) on the
queries, masked_out_value -2.3819763e38, Softmax over kv_seq.  With QK norm each attention builds a
`query_norm` and `key_norm` (RMSLayerNorm over the projection axis, own scales) that sit in the query /
key sequentials between the Linear and ApplyRoPE.  `attention_type` cycles (sliding window 4, sliding
window 4, global) over the 3 blocks.  No cache.
Slip: the global-attention branch of the builder assembles `input_to_query` from the pre-Gemma-3
recipe ([Linear, ApplyRoPE, ConstantRescale]): block 2 builds its `query_norm` but never applies it;
its `key_norm` is applied.  Blocks 0 and 1 are right.
"""


import dataclasses
import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": [
        "body.blocks.0.attention",
        "body.blocks.1.attention",
        "body.blocks.2.attention",
    ],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "body.blocks.2.attention",
    "stage": "normed_queries",
    "mistake": "qk_norm_missing",
    "style": "penzai llamalike_common: pz.nn.Attention as five sub-Sequentials (input_to_query/key/value, "
    "query_key_to_attn, attn_value_to_output), per-head query_norm/key_norm before ApplyRoPE (use_qk_norm), GQA "
    "(kv_heads, q_rep); the global block's input_to_query omits its query_norm",
}

MASKED_OUT = -2.3819763e38


@dataclasses.dataclass(frozen=True)
class AttentionTypeGlobalCausal:
    pass


@dataclasses.dataclass(frozen=True)
class AttentionTypeSlidingWindowCausal:
    window_size: int


class NamedLinear(nn.Module):
    """pz.nn.Linear: an einsum between the input's named axes and a weight with in/out axes."""

    def __init__(self, eqn, shape, fan_in):
        super().__init__()
        self.eqn = eqn
        self.weights = nn.Parameter(torch.randn(shape) / math.sqrt(fan_in))

    def forward(self, x, side):
        return torch.einsum(self.eqn, x, self.weights)


class ApplyRoPE(nn.Module):
    def __init__(self, max_wavelength=10000.0):
        super().__init__()
        self.max_wavelength = max_wavelength

    def forward(self, x, side):
        # x (b, s, ..., p); side["token_positions"] (b, s)
        positions = side["token_positions"]
        p = x.shape[-1]
        freq_exponents = 2 * torch.arange(p // 2, dtype=torch.float64) / p
        timescale = self.max_wavelength**freq_exponents
        inputs = positions.to(torch.float64)[..., None] / timescale
        while inputs.dim() < x.dim():
            inputs = inputs.unsqueeze(-2)
        sin = torch.sin(inputs).to(x.dtype)
        cos = torch.cos(inputs).to(x.dtype)
        first_half, second_half = x[..., : p // 2], x[..., p // 2 :]
        first_part = first_half * cos - second_half * sin
        second_part = second_half * cos + first_half * sin
        return torch.cat([first_part, second_part], dim=-1)


class ConstantRescale(nn.Module):
    def __init__(self, by):
        super().__init__()
        self.by = by

    def forward(self, x, side):
        return x * self.by


class NamedEinsum(nn.Module):
    def __init__(self, eqn):
        super().__init__()
        self.eqn = eqn

    def forward(self, xs, side):
        return torch.einsum(self.eqn, *xs)


class ApplyCausalAttentionMask(nn.Module):
    def forward(self, x, side):
        q_pos = side["token_positions"][:, :, None]
        k_pos = side["kv_token_positions"][:, None, :]
        mask = (q_pos >= k_pos)[:, :, None, None, :]  # b s k r t
        return torch.where(mask, x, torch.tensor(MASKED_OUT, dtype=x.dtype))


class ApplyCausalSlidingWindowAttentionMask(nn.Module):
    def __init__(self, sliding_window_size):
        super().__init__()
        self.sliding_window_size = sliding_window_size

    def forward(self, x, side):
        q_pos = side["token_positions"][:, :, None]
        k_pos = side["kv_token_positions"][:, None, :]
        mask = (q_pos >= k_pos) & (q_pos - k_pos < self.sliding_window_size)
        return torch.where(mask[:, :, None, None, :], x, torch.tensor(MASKED_OUT, dtype=x.dtype))


class Softmax(nn.Module):
    def forward(self, x, side):
        return F.softmax(x, dim=-1)


class Sequential(nn.Module):
    def __init__(self, sublayers):
        super().__init__()
        self.sublayers = nn.ModuleList(sublayers)

    def forward(self, x, side):
        for layer in self.sublayers:
            x = layer(x, side)
        return x


class Attention(nn.Module):
    """pz.nn.Attention: query/key/value sub-networks, then attn = f(q, k), out = g(attn, v)."""

    def __init__(self, input_to_query, input_to_key, input_to_value, query_key_to_attn, attn_value_to_output,
                 query_norm=None, key_norm=None):
        super().__init__()
        self.query_norm = query_norm
        self.key_norm = key_norm
        self.input_to_query = input_to_query
        self.input_to_key = input_to_key
        self.input_to_value = input_to_value
        self.query_key_to_attn = query_key_to_attn
        self.attn_value_to_output = attn_value_to_output

    def forward(self, x, side):
        query = self.input_to_query(x, side)
        key = self.input_to_key(x, side)
        value = self.input_to_value(x, side)
        attn = self.query_key_to_attn((query, key), side)
        return self.attn_value_to_output((attn, value), side)


class AttnWeightsEinsum(NamedEinsum):
    def forward(self, xs, side):
        query, key = xs
        return torch.einsum("bskrp,btkp->bskrt", query, key)


class AttnValueEinsum(NamedEinsum):
    def forward(self, xs, side):
        attn, value = xs
        return torch.einsum("bskrt,btkp->bskrp", attn, value)


def build_llamalike_attention(config, block_index):
    e, k, r, p = config.embedding_dim, config.num_kv_heads, config.query_head_multiplier, config.projection_dim
    attention_type = config.attention_type[block_index % len(config.attention_type)]
    query_norm = RMSLayerNorm(p)
    key_norm = RMSLayerNorm(p)
    if isinstance(attention_type, AttentionTypeSlidingWindowCausal):
        masker = ApplyCausalSlidingWindowAttentionMask(attention_type.window_size)
        input_to_query = Sequential([
            NamedLinear("bse,ekrp->bskrp", (e, k, r, p), e),
            query_norm,
            ApplyRoPE(config.rope_wavelength),
            ConstantRescale(by=p**-0.5),
        ])
    else:
        masker = ApplyCausalAttentionMask()
        input_to_query = Sequential([
            NamedLinear("bse,ekrp->bskrp", (e, k, r, p), e),
            ApplyRoPE(config.rope_wavelength),
            ConstantRescale(by=p**-0.5),
        ])
    return Attention(
        input_to_query=input_to_query,
        input_to_key=Sequential([
            NamedLinear("bse,ekp->bskp", (e, k, p), e), key_norm, ApplyRoPE(config.rope_wavelength)
        ]),
        input_to_value=Sequential([NamedLinear("bse,ekp->bskp", (e, k, p), e)]),
        query_key_to_attn=Sequential([AttnWeightsEinsum(""), masker, Softmax()]),
        attn_value_to_output=Sequential([AttnValueEinsum(""), NamedLinear("bskrp,krpe->bse", (k, r, p, e), k * r * p)]),
        query_norm=query_norm,
        key_norm=key_norm,
    )


class RMSLayerNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x, side=None):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.scale


class LlamalikeMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        e, h = config.embedding_dim, config.mlp_hidden_dim
        self.gating = NamedLinear("bse,eh->bsh", (e, h), e)
        self.value = NamedLinear("bse,eh->bsh", (e, h), e)
        self.out = NamedLinear("bsh,he->bse", (h, e), h)

    def forward(self, x, side):
        return self.out(F.silu(self.gating(x, side)) * self.value(x, side), side)


class TransformerBlock(nn.Module):
    def __init__(self, config, block_index):
        super().__init__()
        self.pre_attention_norm = RMSLayerNorm(config.embedding_dim)
        self.attention = build_llamalike_attention(config, block_index)
        self.pre_ffw_norm = RMSLayerNorm(config.embedding_dim)
        self.mlp = LlamalikeMLP(config)

    def forward(self, x, side):
        x = x + self.attention(self.pre_attention_norm(x), side)
        return x + self.mlp(self.pre_ffw_norm(x), side)


class Body(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embedding = nn.Parameter(torch.randn(config.vocab_size, config.embedding_dim) * 0.5)
        self.blocks = nn.ModuleList([TransformerBlock(config, i) for i in range(config.num_decoder_blocks)])
        self.final_norm = RMSLayerNorm(config.embedding_dim)
        self.logits = NamedLinear("bse,ev->bsv", (config.embedding_dim, config.vocab_size), config.embedding_dim)

    def forward(self, tokens, side):
        x = self.embedding[tokens]
        for block in self.blocks:
            x = block(x, side)
        return self.logits(self.final_norm(x), side)


class TransformerLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.body = Body(config)

    def forward(self, tokens):
        b, s = tokens.shape
        token_positions = torch.arange(s, device=tokens.device)[None, :].expand(b, s)
        side = {"token_positions": token_positions, "kv_token_positions": token_positions}
        return self.body(tokens, side)


def make_model():
    torch.manual_seed(2307)
    config = SimpleNamespace(
        num_kv_heads=2,
        query_head_multiplier=2,
        embedding_dim=64,
        projection_dim=16,
        mlp_hidden_dim=128,
        num_decoder_blocks=3,
        vocab_size=96,
        rope_wavelength=10000.0,
        attention_type=(
            AttentionTypeSlidingWindowCausal(4), AttentionTypeSlidingWindowCausal(4), AttentionTypeGlobalCausal()
        ),
        use_qk_norm=True,
    )
    model = TransformerLM(config)
    g = torch.Generator().manual_seed(23071)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSLayerNorm):
                m.scale.copy_(1.0 + 0.3 * torch.randn(m.scale.shape, generator=g))
    return model.eval()

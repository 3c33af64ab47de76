"""Penzai's llamalike transformer in sampling mode (penzai/models/transformer/sampling_mode.py,
KVCachingAttention), ported from JAX.

The model is penzai's llamalike one: `body.blocks.N.attention` is a `pz.nn.Attention` of five
sub-sequentials (`input_to_query` [Linear, ApplyRoPE, ConstantRescale], `input_to_key`, `input_to_value`,
`query_key_to_attn` [NamedEinsum, mask, Softmax], `attn_value_to_output` [NamedEinsum, Linear]), GQA as 2
kv heads x 2 query repeats (projection 16), ApplyRoPE on halves (1e4), masked_out_value -2.3819763e38.
`attention_type` cycles (AttentionTypeSlidingWindowCausal(3), AttentionTypeGlobalCausal()) over 4
blocks.  Sampling mode turns each attention into a KVCachingAttention: a `kv_cache` state (4, 64, kv,
projection) per attention written at the model's `cache_end_index`, side inputs `token_positions` =
cache_end_index + arange(s) and `kv_token_positions` = arange(cache_len) (unwritten slots are hidden
by the causal test, since their positions lie in the future).
Cache: book-buffers: `model.reset_kv_cache()`, `model(prompt, use_cache=True)`, `model(tok, use_cache=True)`;
`model(ids)` is the plain (uncached) model; returns the logits tensor.
Slip: the sampling-mode conversion swaps each sliding-window masker for a cache-slot version written
as `(k_pos <= q_pos) & (k_pos >= q_pos - window)`, which lets window + 1 = 4 keys through.  The prompt
pass is run by the uncached maskers and is exact; from the first decoded token whose position is 3 or
more (step 0 for prompts of 3 or more tokens), blocks 0 and 2 see one key too many.
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
        "body.blocks.3.attention",
    ],
    "kind": "causal-multihead",
    "cache": "book-buffers",
    "decode": {"mistake": "cache_mask", "step": 0, "layer": "body.blocks.0.attention"},
    "style": "penzai llamalike_common: pz.nn.Attention as five sub-Sequentials (input_to_query/key/value, "
    "query_key_to_attn, attn_value_to_output), GQA (kv_heads, q_rep), sliding window 3 / global; sampling mode "
    "KVCachingAttention with kv_cache state and cache_end_index; the cached sliding mask keeps k_pos >= q_pos - window "
    "(window + 1 keys) (prompts >= 3)",
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

    def __init__(self, input_to_query, input_to_key, input_to_value, query_key_to_attn, attn_value_to_output):
        super().__init__()
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


class CacheSlotSlidingWindowMask(nn.Module):
    """Sampling-mode masker over cache slots."""

    def __init__(self, sliding_window_size):
        super().__init__()
        self.sliding_window_size = sliding_window_size

    def forward(self, x, side):
        q_pos = side["token_positions"][:, :, None]
        k_pos = side["kv_token_positions"][:, None, :]
        mask = (k_pos <= q_pos) & (k_pos >= q_pos - self.sliding_window_size)
        return torch.where(mask[:, :, None, None, :], x, torch.tensor(MASKED_OUT, dtype=x.dtype))


class KVCachingAttention(Attention):
    """Attention whose keys/values are appended to a `kv_cache` state in sampling mode."""

    def __init__(self, attention, cached_masker, cache_len=64, batch_size=4):
        super().__init__(attention.input_to_query, attention.input_to_key, attention.input_to_value,
                         attention.query_key_to_attn, attention.attn_value_to_output)
        self.cached_masker = cached_masker
        self.cache_len = cache_len
        self.batch_size = batch_size
        self.kv_cache = None

    def reset(self, k, p, dtype):
        shape = (self.batch_size, self.cache_len, k, p)
        self.kv_cache = (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))

    def forward(self, x, side):
        if "cache_end_index" not in side:
            return super().forward(x, side)
        query = self.input_to_query(x, side)
        key = self.input_to_key(x, side)
        value = self.input_to_value(x, side)
        b, s = x.shape[:2]
        start = side["cache_end_index"]
        k_cache, v_cache = self.kv_cache
        k_cache, v_cache = k_cache.to(key.dtype), v_cache.to(value.dtype)
        k_cache[:b, start : start + s] = key
        v_cache[:b, start : start + s] = value
        self.kv_cache = (k_cache, v_cache)
        kv_side = dict(side, kv_token_positions=torch.arange(self.cache_len)[None, :].expand(b, -1))
        attn_einsum, masker, softmax = self.query_key_to_attn.sublayers
        if start > 0 and self.cached_masker is not None:
            masker = self.cached_masker
        attn = attn_einsum((query, k_cache[:b]), kv_side)
        attn = softmax(masker(attn, kv_side), kv_side)
        return self.attn_value_to_output((attn, v_cache[:b]), kv_side)


def build_llamalike_attention(config, block_index):
    e, k, r, p = config.embedding_dim, config.num_kv_heads, config.query_head_multiplier, config.projection_dim
    attention_type = config.attention_type[block_index % len(config.attention_type)]
    if isinstance(attention_type, AttentionTypeSlidingWindowCausal):
        masker = ApplyCausalSlidingWindowAttentionMask(attention_type.window_size)
    else:
        masker = ApplyCausalAttentionMask()
    attention = Attention(
        input_to_query=Sequential([
            NamedLinear("bse,ekrp->bskrp", (e, k, r, p), e),
            ApplyRoPE(config.rope_wavelength),
            ConstantRescale(by=p**-0.5),
        ]),
        input_to_key=Sequential([NamedLinear("bse,ekp->bskp", (e, k, p), e), ApplyRoPE(config.rope_wavelength)]),
        input_to_value=Sequential([NamedLinear("bse,ekp->bskp", (e, k, p), e)]),
        query_key_to_attn=Sequential([AttnWeightsEinsum(""), masker, Softmax()]),
        attn_value_to_output=Sequential([AttnValueEinsum(""), NamedLinear("bskrp,krpe->bse", (k, r, p, e), k * r * p)]),
    )
    # sampling_mode: KVCachingAttention.from_uncached(...)
    if isinstance(attention_type, AttentionTypeSlidingWindowCausal):
        cached_masker = CacheSlotSlidingWindowMask(attention_type.window_size)
    else:
        cached_masker = None
    return KVCachingAttention(attention, cached_masker)


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

        self.cache_end_index = 0

    def reset_kv_cache(self):
        self.cache_end_index = 0
        dtype = self.body.embedding.dtype
        for block in self.body.blocks:
            block.attention.reset(self.config.num_kv_heads, self.config.projection_dim, dtype)

    def forward(self, tokens, use_cache=False):
        b, s = tokens.shape
        if not use_cache:
            token_positions = torch.arange(s, device=tokens.device)[None, :].expand(b, s)
            side = {"token_positions": token_positions, "kv_token_positions": token_positions}
            return self.body(tokens, side)
        if self.body.blocks[0].attention.kv_cache is None:
            self.reset_kv_cache()
        start = self.cache_end_index
        token_positions = (start + torch.arange(s, device=tokens.device))[None, :].expand(b, s)
        side = {"token_positions": token_positions, "cache_end_index": start}
        out = self.body(tokens, side)
        self.cache_end_index = start + s
        return out


def make_model():
    torch.manual_seed(2312)
    config = SimpleNamespace(
        num_kv_heads=2,
        query_head_multiplier=2,
        embedding_dim=64,
        projection_dim=16,
        mlp_hidden_dim=128,
        num_decoder_blocks=4,
        vocab_size=96,
        rope_wavelength=10000.0,
        attention_type=(AttentionTypeSlidingWindowCausal(3), AttentionTypeGlobalCausal()),
    )
    model = TransformerLM(config)
    g = torch.Generator().manual_seed(23121)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSLayerNorm):
                m.scale.copy_(1.0 + 0.3 * torch.randn(m.scale.shape, generator=g))
    return model.eval()

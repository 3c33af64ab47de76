"""EasyLM's Flax LLaMA (EasyLM/models/llama/llama_model.py) ported to PyTorch module by module.

The Flax tree is kept: FlaxLLaMAForCausalLMModule -> transformer (FlaxLLaMAModule: wte, h, ln_f),
h = FlaxLLaMABlockCollection whose blocks are named "0", "1", "2" (a ModuleDict here), each block
FlaxLLaMABlock: attention_norm, attention, ffn_norm, feed_forward.  Dense layers are ported as
`Dense` modules holding a Flax-layout `kernel` (in_features, out_features) and applied as x @ kernel.
FlaxLLaMAAttention: wq/wk/wv/wo (no bias), complex rotary (interleaved pairs, theta 1e4) from a
precomputed freq_cis table, causal mask turned into an additive bias (0 / finfo.min) the way
flax.linen.make_causal_mask + lax.select do it, query / sqrt(head_dim), then an `attention_weights`
function.  Blocks 0 and 1 use `dot_product_attention_weights` (jax.nn.softmax over keys).
Slip: block "2" was built from a config that sets `attn_fn="sigmoid"` (a leftover of a sigmoid-
attention experiment), so its weights are sigmoid(masked scores): not a softmax.
No cache.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": [
        "transformer.h.0.attention",
        "transformer.h.1.attention",
        "transformer.h.2.attention",
    ],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "transformer.h.2.attention",
    "stage": "weights",
    "mistake": "not_softmax",
    "style": "EasyLM Flax LLaMA ported: Dense modules with (in, out) `kernel`, FlaxLLaMABlockCollection as ModuleDict "
    "'0'..'2', complex freq_cis rotary, additive 0/finfo.min bias from make_causal_mask; block 2's attention "
    "weights are jax.nn.sigmoid of the masked scores instead of softmax",
}


class Dense(nn.Module):
    def __init__(self, in_features, features, use_bias=False):
        super().__init__()
        self.kernel = nn.Parameter(torch.randn(in_features, features) / math.sqrt(in_features))
        self.bias = nn.Parameter(torch.zeros(features)) if use_bias else None

    def forward(self, x):
        y = x @ self.kernel
        return y + self.bias if self.bias is not None else y


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.kernel = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.kernel


def precompute_freqs_cis(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64)[: (dim // 2)] / dim))
    t = torch.arange(end, dtype=torch.float64)
    freqs = torch.outer(t, freqs)
    return torch.cos(freqs), torch.sin(freqs)


def apply_rotary_emb(xq, xk, cos, sin):
    # (b, s, h, d) viewed as d/2 complex numbers (x[2i], x[2i+1])
    def rot(x):
        xr = x.reshape(*x.shape[:-1], -1, 2)
        a, b = xr[..., 0], xr[..., 1]
        c, s_ = cos[None, :, None, :], sin[None, :, None, :]
        return torch.stack([a * c - b * s_, a * s_ + b * c], dim=-1).reshape(x.shape)

    return rot(xq), rot(xk)


def make_causal_bias(seq_len, dtype, device):
    causal = torch.tril(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device))
    return torch.where(
        causal,
        torch.tensor(0.0, dtype=dtype, device=device),
        torch.tensor(torch.finfo(dtype).min, dtype=dtype, device=device),
    )


def dot_product_attention_weights(query, key, bias):
    # flax.linen.dot_product_attention_weights: query (b, q, h, d), key (b, k, h, d)
    query = query / math.sqrt(query.shape[-1])
    attn_weights = torch.einsum("...qhd,...khd->...hqk", query, key)
    attn_weights = attn_weights + bias
    return torch.softmax(attn_weights, dim=-1)


def sigmoid_attention_weights(query, key, bias):
    query = query / math.sqrt(query.shape[-1])
    attn_weights = torch.einsum("...qhd,...khd->...hqk", query, key)
    attn_weights = attn_weights + bias
    return torch.sigmoid(attn_weights)


ATTN_FNS = {"softmax": dot_product_attention_weights, "sigmoid": sigmoid_attention_weights}


class FlaxLLaMAAttention(nn.Module):
    def __init__(self, config, attn_fn="softmax"):
        super().__init__()
        self.embed_dim = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.embed_dim // self.num_heads
        self.wq = Dense(self.embed_dim, self.embed_dim)
        self.wk = Dense(self.embed_dim, self.embed_dim)
        self.wv = Dense(self.embed_dim, self.embed_dim)
        self.wo = Dense(self.embed_dim, self.embed_dim)
        self.attention_weights = ATTN_FNS[attn_fn]
        cos, sin = precompute_freqs_cis(self.head_dim, config.max_sequence_length * 2)
        self.register_buffer("freq_cos", cos.float(), persistent=False)
        self.register_buffer("freq_sin", sin.float(), persistent=False)

    def _split_heads(self, hidden_states):
        return hidden_states.reshape(hidden_states.shape[:2] + (self.num_heads, self.head_dim))

    def _merge_heads(self, hidden_states):
        return hidden_states.reshape(hidden_states.shape[:2] + (self.embed_dim,))

    def forward(self, hidden_states, attention_bias, position_ids):
        xq, xk, xv = self.wq(hidden_states), self.wk(hidden_states), self.wv(hidden_states)
        xq, xk, xv = self._split_heads(xq), self._split_heads(xk), self._split_heads(xv)
        cos = self.freq_cos[position_ids].to(xq.dtype)
        sin = self.freq_sin[position_ids].to(xq.dtype)
        xq, xk = apply_rotary_emb(xq, xk, cos, sin)
        attn_weights = self.attention_weights(xq, xk, attention_bias)
        attn_output = torch.einsum("...hqk,...khd->...qhd", attn_weights, xv)
        return self.wo(self._merge_heads(attn_output))


class FlaxLLaMAMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.w1 = Dense(config.hidden_size, config.intermediate_size)
        self.w2 = Dense(config.intermediate_size, config.hidden_size)
        self.w3 = Dense(config.hidden_size, config.intermediate_size)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class FlaxLLaMABlock(nn.Module):
    def __init__(self, config, attn_fn):
        super().__init__()
        self.attention = FlaxLLaMAAttention(config, attn_fn)
        self.feed_forward = FlaxLLaMAMLP(config)
        self.attention_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.ffn_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_bias, position_ids):
        attn_output = self.attention(
            self.attention_norm(hidden_states), attention_bias, position_ids
        )
        hidden_states = hidden_states + attn_output
        return hidden_states + self.feed_forward(self.ffn_norm(hidden_states))


class FlaxLLaMAModule(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.h = nn.ModuleDict(
            {
                str(i): FlaxLLaMABlock(config, config.attn_fn_per_block[i])
                for i in range(config.num_hidden_layers)
            }
        )
        self.ln_f = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids):
        b, s = input_ids.shape
        hidden_states = self.wte(input_ids)
        position_ids = torch.arange(s, device=input_ids.device)
        bias = make_causal_bias(s, hidden_states.dtype, input_ids.device)[None, None]
        for block in self.h.values():
            hidden_states = block(hidden_states, bias, position_ids)
        return self.ln_f(hidden_states)


class FlaxLLaMAForCausalLMModule(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.transformer = FlaxLLaMAModule(config)
        self.lm_head = Dense(config.hidden_size, config.vocab_size)

    def forward(self, input_ids):
        return self.lm_head(self.transformer(input_ids))


def make_model():
    torch.manual_seed(805)
    config = SimpleNamespace(
        vocab_size=130,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        max_sequence_length=64,
        rms_norm_eps=1e-6,
        attn_fn_per_block=["softmax", "softmax", "sigmoid"],
    )
    model = FlaxLLaMAForCausalLMModule(config)
    g = torch.Generator().manual_seed(8051)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.kernel.copy_(1.0 + 0.3 * torch.randn(m.kernel.shape, generator=g))
    return model.eval()

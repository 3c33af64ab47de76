"""EasyLM (young-geng/EasyLM, llama_model.py, FlaxLLaMAAttention) ported from JAX/Flax to torch:
wq/wk/wv/wo without bias, (B, T, H, D) layout throughout, precompute_freqs_cis as complex numbers
(computed in float64, cast to the input's complex dtype) and apply_rotary_emb via complex
multiplication of adjacent pairs (rope_theta 500000, the LLaMA-3 setting), grouped kv heads widened with
jnp.repeat along the head axis (repeat_interleave), make_causal_mask turned into an additive bias with
jnp.where(mask, 0, finfo.min), einsum attention ("...qhd,...khd->...hqk") as in
flax.linen.dot_product_attention_weights (query divided by sqrt(depth)), softmax, einsum with the values.

This file: one bug: the query is not divided by sqrt(depth) in the port of dot_product_attention_weights."""

import torch
import torch.nn.functional as F
from torch import nn


class LLaMAConfig:
    hidden_size = 64
    intermediate_size = 128
    num_attention_heads = 8
    num_key_value_heads = 2
    rms_norm_eps = 1e-6
    rope_theta = 500000.0
    max_position_embeddings = 128


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.kernel = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.kernel


def precompute_freqs_cis(dim, end, theta):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64)[: (dim // 2)] / dim))
    t = torch.arange(end, dtype=torch.float64)
    freqs = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(freqs), freqs)  # complex128, (end, dim // 2)


def apply_rotary_emb(xq, xk, freqs_cis):
    cdtype = torch.complex64 if xq.dtype == torch.float32 else torch.complex128
    reshape_xq = xq.reshape(*xq.shape[:-1], -1, 2)
    reshape_xk = xk.reshape(*xk.shape[:-1], -1, 2)
    xq_ = torch.complex(reshape_xq[..., 0], reshape_xq[..., 1])
    xk_ = torch.complex(reshape_xk[..., 0], reshape_xk[..., 1])
    freqs_cis = freqs_cis.to(cdtype)[None, :, None, :]  # (1, T, 1, D/2)
    xq_out = xq_ * freqs_cis
    xk_out = xk_ * freqs_cis
    xq_out = torch.stack((xq_out.real, xq_out.imag), dim=-1).reshape(xq.shape)
    xk_out = torch.stack((xk_out.real, xk_out.imag), dim=-1).reshape(xk.shape)
    return xq_out.to(xq.dtype), xk_out.to(xk.dtype)


def make_causal_mask(seq_len, device):
    idx = torch.arange(seq_len, device=device)
    return (idx[:, None] >= idx[None, :])[None, None]  # (1, 1, T, T), True where the key is visible


def dot_product_attention_weights(query, key, bias):
    """flax.linen.dot_product_attention_weights, (B, T, H, D) inputs."""
    depth = query.shape[-1]
    # flax scales inside dot_product_attention; the port calls the weights helper without it
    attn_weights = torch.einsum("...qhd,...khd->...hqk", query, key)
    attn_weights = attn_weights + bias
    return F.softmax(attn_weights, dim=-1)


class FlaxLLaMAAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_dim = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.head_dim = self.embed_dim // self.num_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.wq = nn.Linear(self.embed_dim, self.num_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(self.embed_dim, self.num_key_value_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(self.embed_dim, self.num_key_value_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.num_heads * self.head_dim, self.embed_dim, bias=False)

    def _split_heads(self, hidden_states, num_heads):
        return hidden_states.reshape(hidden_states.shape[:2] + (num_heads, self.head_dim))

    def _merge_heads(self, hidden_states):
        return hidden_states.reshape(hidden_states.shape[:2] + (self.embed_dim,))

    def forward(self, hidden_states, position_ids):
        xq, xk, xv = self.wq(hidden_states), self.wk(hidden_states), self.wv(hidden_states)
        xq = self._split_heads(xq, self.num_heads)
        xk = self._split_heads(xk, self.num_key_value_heads)
        xv = self._split_heads(xv, self.num_key_value_heads)

        # a constant table in the Flax module; rebuilt here in float64 (not a buffer, so .to() never casts it)
        freqs_cis = precompute_freqs_cis(
            self.head_dim, self.config.max_position_embeddings * 2, self.config.rope_theta
        ).to(xq.device)[position_ids[0]]
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)

        # jnp.repeat(xk, num_key_value_groups, axis=2)
        xk = torch.repeat_interleave(xk, self.num_key_value_groups, dim=2)
        xv = torch.repeat_interleave(xv, self.num_key_value_groups, dim=2)

        query_length = xq.shape[1]
        causal_mask = make_causal_mask(query_length, xq.device)
        attention_bias = torch.where(
            causal_mask,
            torch.zeros((), dtype=xq.dtype, device=xq.device),
            torch.full((), torch.finfo(xq.dtype).min, dtype=xq.dtype, device=xq.device),
        )
        attn_weights = dot_product_attention_weights(xq, xk, attention_bias)
        attn_output = torch.einsum("...hqk,...khd->...qhd", attn_weights, xv)
        attn_output = self._merge_heads(attn_output)
        return self.wo(attn_output)


class FlaxLLaMABlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention = FlaxLLaMAAttention(config)
        self.attention_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.ffn_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.w1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.w3 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)

    def forward(self, hidden_states):
        position_ids = torch.arange(hidden_states.shape[1], device=hidden_states.device)[None]
        h = hidden_states + self.attention(self.attention_norm(hidden_states), position_ids)
        x = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(x)) * self.w3(x))


def make_easylm_block():
    torch.manual_seed(2562)
    block = FlaxLLaMABlock(LLaMAConfig())
    with torch.no_grad():
        for mod in block.modules():
            if isinstance(mod, RMSNorm):
                mod.kernel.uniform_(0.5, 1.5)
    return block.eval()


EXPECT = {
    "target": "make_easylm_block",
    "kind": "causal-multihead",
    "ok": False,
    "layer": "attention",
    "stage": "scaled_scores",
    "mistake": "missing_scale",
    "style": "EasyLM torch port: query / sqrt(depth) dropped from dot_product_attention_weights",
}

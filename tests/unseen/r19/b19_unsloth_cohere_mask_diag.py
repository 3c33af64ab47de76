"""unslothai/unsloth patched attention (`LlamaAttention_fast_forward` / `CohereAttention_fast_forward`)
in plain torch: `apply_qkv` / `apply_o` hooks around `q_proj`/`k_proj`/`v_proj`/`o_proj`, heads
`view(bsz, q_len, n, d).transpose(1, 2)`, the rotary module's `get_cached(kv_seq_len)` cos/sin cache,
the torch fallback of `inplace_rope_embedding` (`Q *= cos; Q.addcmul_(rotate(Q), sin)`), GQA by
`K[:, :, None, :, :].expand(bsz, n_kv_heads, n_groups, kv_seq_len, head_dim).reshape(...)`, and the
manual matmul path of the fast inference kernel in place of SDPA (`Qn *= self.scalar`, matmul,
float32-capable softmax, matmul) with the model's additive `finfo.min` causal mask. Cohere variant
(`CohereAttention_fast_forward`): `use_qk_norm` with `CohereLayerNorm((n_heads, head_dim), bias=False)`
(mean-centred, one gain per head and channel) on Q and K before the rotary, and Cohere's interleaved
rotary (`repeat_interleave(freqs, 2)`, `stack([-x2, x1]).flatten(-2)` on even/odd channels).

This file: one bug: the model's finfo.min mask is built with triu(diagonal=0), which also hides each query's own key."""

import math

import torch
from torch import nn


class Config:
    hidden_size = 64
    num_attention_heads = 4
    num_key_value_heads = 2
    rope_theta = 10000.0
    max_position_embeddings = 64
    layer_norm_eps = 1e-5
    use_qk_norm = True

class CohereLayerNorm(nn.Module):
    def __init__(self, hidden_size=None, eps=1e-5, bias=False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        mean = hidden_states.mean(-1, keepdim=True)
        variance = (hidden_states - mean).pow(2).mean(-1, keepdim=True)
        hidden_states = (hidden_states - mean) * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, max_position_embeddings=64, base=10000.0):
        super().__init__()
        self.dim = dim
        self.base = base
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._set_cos_sin_cache(max_position_embeddings, torch.float32)

    def _set_cos_sin_cache(self, seq_len, dtype):
        self.max_seq_len_cached = seq_len
        t = torch.arange(seq_len, dtype=torch.float64)
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.repeat_interleave(freqs, 2, dim=-1)
        self.cos_cached = emb.cos().to(dtype)
        self.sin_cached = emb.sin().to(dtype)

    def get_cached(self, seq_len, dtype):
        if seq_len > self.max_seq_len_cached or self.cos_cached.dtype != dtype:
            self._set_cos_sin_cache(max(seq_len, self.max_seq_len_cached), dtype)
        return self.cos_cached[:seq_len], self.sin_cached[:seq_len]


def inplace_rope_embedding(Q, K, cos, sin):
    """torch fallback of unsloth's fused rope kernel, on (bsz, n_heads, seq_len, head_dim)."""
    Q = Q.clone()
    K = K.clone()
    cos, sin = cos[None, None], sin[None, None]
    RH_Q = torch.stack((-Q[..., 1::2], Q[..., ::2]), dim=-1).flatten(-2)
    RH_K = torch.stack((-K[..., 1::2], K[..., ::2]), dim=-1).flatten(-2)
    Q *= cos
    Q.addcmul_(RH_Q, sin)
    K *= cos
    K.addcmul_(RH_K, sin)
    return Q, K


def apply_qkv(self, X):
    return self.q_proj(X), self.k_proj(X), self.v_proj(X)


def apply_o(self, X):
    return self.o_proj(X)


class CohereAttention(nn.Module):
    def __init__(self, config, layer_idx=0):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.use_qk_norm = config.use_qk_norm
        if self.use_qk_norm:
            self.q_norm = CohereLayerNorm((self.num_heads, self.head_dim), eps=config.layer_norm_eps)
            self.k_norm = CohereLayerNorm((self.num_key_value_heads, self.head_dim), eps=config.layer_norm_eps)
        self.rotary_emb = RotaryEmbedding(self.head_dim, config.max_position_embeddings, config.rope_theta)
        self.apply_qkv = apply_qkv
        self.apply_o = apply_o
        self.scalar = 1.0 / math.sqrt(self.head_dim)

    def forward(self, hidden_states, attention_mask=None, position_ids=None):
        bsz, q_len, _ = hidden_states.size()
        n_heads = self.num_heads
        n_groups = self.num_key_value_groups
        n_kv_heads = self.num_key_value_heads
        head_dim = self.head_dim

        Q, K, V = self.apply_qkv(self, hidden_states)
        Q = Q.view(bsz, q_len, n_heads, head_dim).transpose(1, 2)
        K = K.view(bsz, q_len, n_kv_heads, head_dim).transpose(1, 2)
        V = V.view(bsz, q_len, n_kv_heads, head_dim).transpose(1, 2)
        if self.use_qk_norm:
            # CohereLayerNorm works on (..., n_heads, head_dim)
            Q = self.q_norm(Q.transpose(1, 2)).transpose(1, 2)
            K = self.k_norm(K.transpose(1, 2)).transpose(1, 2)
        kv_seq_len = K.shape[-2]
        cos, sin = self.rotary_emb.get_cached(kv_seq_len, Q.dtype)
        Q, K = inplace_rope_embedding(Q, K, cos, sin)

        if n_groups != 1:
            K = K[:, :, None, :, :].expand(bsz, n_kv_heads, n_groups, kv_seq_len, head_dim)
            V = V[:, :, None, :, :].expand(bsz, n_kv_heads, n_groups, kv_seq_len, head_dim)
            K = K.reshape(bsz, n_heads, kv_seq_len, head_dim)
            V = V.reshape(bsz, n_heads, kv_seq_len, head_dim)

        # manual path of the fast inference kernel (stand-in for SDPA)
        Qn = Q * self.scalar
        A = torch.matmul(Qn, K.transpose(2, 3))
        if attention_mask is not None:
            A = A + attention_mask
        A = torch.nn.functional.softmax(A, dim=-1)
        A = torch.matmul(A, V)
        A = A.transpose(1, 2).contiguous()
        A = A.reshape(bsz, q_len, n_heads * head_dim)
        return self.apply_o(self, A)


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = CohereAttention(config, layer_idx)

    def forward(self, hidden_states, attention_mask, position_ids):
        return self.self_attn(hidden_states, attention_mask=attention_mask, position_ids=position_ids)


class Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList([DecoderLayer(config, 0)])

    def forward(self, inputs_embeds):
        bsz, seq_len, _ = inputs_embeds.shape
        dtype = inputs_embeds.dtype
        position_ids = torch.arange(seq_len, device=inputs_embeds.device)[None].expand(bsz, -1)
        mask = torch.full((seq_len, seq_len), torch.finfo(dtype).min, dtype=dtype, device=inputs_embeds.device)
        mask = torch.triu(mask, diagonal=0)
        attention_mask = mask[None, None]
        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask, position_ids)
        return hidden_states


def make_unsloth_cohere():
    torch.manual_seed(1966)
    model = Model(Config())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, CohereLayerNorm):
                mod.weight.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {'target': 'make_unsloth_cohere',
 'kind': 'causal-multihead',
 'ok': False,
 'layer': 'layers.0.self_attn',
 'stage': 'masked_scores',
 'mistake': 'mask_diagonal',
 'style': 'unsloth CohereAttention_fast_forward: model mask built with triu(diagonal=0), hiding '
          "each query's own key"}

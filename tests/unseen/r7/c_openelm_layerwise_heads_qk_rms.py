"""OpenELM-style decoder layer with layer-wise head counts (layer 1: 4 query heads, 2 kv heads), RMSNorm on q and k per head."""

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn


def make_divisible(v, divisor=8):
    return max(divisor, int(v + divisor / 2) // divisor * divisor)


class OpenELMRMSNorm(nn.Module):
    def __init__(self, num_features, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(num_features))
        self.num_features = num_features

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        return self._norm(x) * self.weight


class OpenELMRotaryEmbedding(nn.Module):
    """Rotates queries and keys given as (batch, heads, seq, head_dim); queries sit at the end of the key range."""

    def __init__(self, model_dim, max_seq_length, freq_constant=10000):
        super().__init__()
        inv_freq = 1.0 / (
            freq_constant ** (torch.arange(0, model_dim, 2, dtype=torch.float64) / model_dim)
        )
        self.model_dim = model_dim
        self.freq_constant = freq_constant
        self.max_seq_length = max_seq_length
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._cached_cos = None
        self._cached_sin = None
        self._compute_sin_cos_embeddings(max_seq_length)

    def _compute_sin_cos_embeddings(self, key_len, key_device="cpu", key_dtype=torch.float64):
        if (
            key_len > self.max_seq_length
            or self._cached_cos is None
            or self._cached_cos.dtype != key_dtype
        ):
            self.max_seq_length = max(key_len, self.max_seq_length)
            pos_index = torch.arange(self.max_seq_length, dtype=torch.float64, device=key_device)
            pos_index_theta = torch.einsum("i,j->ij", pos_index, self.inv_freq.to(torch.float64))
            emb = torch.cat((pos_index_theta, pos_index_theta), dim=-1)
            self._cached_cos = emb.cos()[None, None].to(key_dtype)
            self._cached_sin = emb.sin()[None, None].to(key_dtype)

    @staticmethod
    def _rotate_half(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def _apply_rotary_pos_emb(self, x, sin, cos):
        return (x * cos) + (self._rotate_half(x) * sin)

    def forward(self, query, key):
        dim = key.shape[-1]
        key_len = key.shape[2]
        query_len = query.shape[2]
        assert dim == self.model_dim
        self._compute_sin_cos_embeddings(key_len, key_device=key.device, key_dtype=key.dtype)
        query = self._apply_rotary_pos_emb(
            query,
            sin=self._cached_sin[..., key_len - query_len : key_len, :],
            cos=self._cached_cos[..., key_len - query_len : key_len, :],
        )
        key = self._apply_rotary_pos_emb(
            key, sin=self._cached_sin[..., :key_len, :], cos=self._cached_cos[..., :key_len, :]
        )
        return query, key


class OpenELMMultiHeadCausalAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        head_dim = config.head_dim
        q_heads = config.num_query_heads[layer_idx]
        k_heads = config.num_kv_heads[layer_idx]
        v_heads = config.num_kv_heads[layer_idx]
        self.qkv_proj = nn.Linear(
            config.model_dim, (q_heads + k_heads + v_heads) * head_dim, bias=False
        )
        self.pos_embedding = OpenELMRotaryEmbedding(
            model_dim=head_dim,
            max_seq_length=config.rope_max_length,
            freq_constant=config.rope_freq_constant,
        )
        if config.normalize_qk_projections:
            self.q_norm = OpenELMRMSNorm(num_features=head_dim)
            self.k_norm = OpenELMRMSNorm(num_features=head_dim)
        else:
            self.q_norm = None
            self.k_norm = None
        self.out_proj = nn.Linear(q_heads * head_dim, config.model_dim, bias=False)
        self.head_dim = head_dim
        self.num_q_heads = q_heads
        self.num_k_heads = k_heads
        self.num_v_heads = v_heads
        self.transformer_dim = config.model_dim
        self.num_groups = self.num_q_heads // self.num_k_heads

    def forward(self, hidden_states, attention_mask=None):
        batch_size, seq_length, d_model = hidden_states.size()
        qkv = self.qkv_proj(hidden_states)
        qkv = qkv.reshape(
            batch_size,
            seq_length,
            self.num_q_heads + self.num_k_heads + self.num_v_heads,
            self.head_dim,
        )
        qkv = qkv.transpose(1, 2)  # (b, total_heads, s, d)
        queries, keys, values = qkv.split(
            [self.num_q_heads, self.num_k_heads, self.num_v_heads], dim=1
        )

        if self.q_norm is not None:
            queries = self.q_norm(queries)
        if self.k_norm is not None:
            keys = self.k_norm(keys)

        queries, keys = self.pos_embedding(queries, keys)

        if self.num_groups != 1:
            keys = keys.repeat_interleave(self.num_groups, dim=1)
            values = values.repeat_interleave(self.num_groups, dim=1)

        causal_mask = attention_mask
        if attention_mask is not None:
            causal_mask = attention_mask[:, :, :, : keys.shape[-2]]
        attn_output = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=causal_mask, dropout_p=0
        )
        attn_output = attn_output.transpose(1, 2).contiguous()
        attn_output = attn_output.reshape(batch_size, seq_length, self.num_q_heads * self.head_dim)
        return self.out_proj(attn_output)


class OpenELMFeedForwardNetwork(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        ffn_multiplier = config.ffn_multipliers[layer_idx]
        intermediate_dim = int(
            make_divisible(ffn_multiplier * config.model_dim, divisor=config.ffn_dim_divisor)
        )
        self.proj_1 = nn.Linear(config.model_dim, 2 * intermediate_dim, bias=False)
        self.proj_2 = nn.Linear(intermediate_dim, config.model_dim, bias=False)

    def forward(self, x):
        y_12 = self.proj_1(x)
        y_1, y_2 = y_12.chunk(2, dim=-1)
        return self.proj_2(F.silu(y_1) * y_2)


class OpenELMDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.attn = OpenELMMultiHeadCausalAttention(config=config, layer_idx=layer_idx)
        self.ffn = OpenELMFeedForwardNetwork(config=config, layer_idx=layer_idx)
        self.ffn_norm = OpenELMRMSNorm(num_features=config.model_dim)
        self.attn_norm = OpenELMRMSNorm(num_features=config.model_dim)

    def forward(self, hidden_states, attention_mask=None):
        residual = hidden_states
        hidden_states = self.attn(self.attn_norm(hidden_states), attention_mask=attention_mask)
        hidden_states = residual + hidden_states
        residual = hidden_states
        return residual + self.ffn(self.ffn_norm(hidden_states))


class OpenELMLayerProbe(nn.Module):
    """One OpenELM decoder layer lifted out of the model, with the model's additive causal mask."""

    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer = OpenELMDecoderLayer(config, layer_idx)

    def forward(self, hidden_states):
        seq_len = hidden_states.shape[1]
        min_dtype = torch.finfo(hidden_states.dtype).min
        causal_mask = torch.full(
            (seq_len, seq_len), min_dtype, dtype=hidden_states.dtype, device=hidden_states.device
        )
        causal_mask = torch.triu(causal_mask, diagonal=1)[None, None]
        return self.layer(hidden_states, attention_mask=causal_mask)


def make_openelm_layer():
    config = SimpleNamespace(
        model_dim=64,
        head_dim=16,
        num_query_heads=[2, 4],
        num_kv_heads=[1, 2],
        ffn_multipliers=[0.5, 1.0],
        ffn_dim_divisor=16,
        normalize_qk_projections=True,
        rope_freq_constant=10000,
        rope_max_length=64,
    )
    probe = OpenELMLayerProbe(config, layer_idx=1)
    g = torch.Generator().manual_seed(21)
    with torch.no_grad():
        attn = probe.layer.attn
        attn.q_norm.weight.copy_(torch.linspace(0.5, 1.6, 16)[torch.randperm(16, generator=g)])
        attn.k_norm.weight.copy_(torch.linspace(1.4, 0.7, 16)[torch.randperm(16, generator=g)])
    return probe


EXPECT = {
    "target": "make_openelm_layer",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "layer.attn",
    "structure": {
        "heads": 4,
        "kv_heads": 2,
        "head_dim": 16,
        "causal": True,
        "cross": False,
        "rope": {"pairing": "half", "fraction": 1.0, "base": 10000},
        "qk_norm": "per-head",
        "window": None,
        "bias": None,
    },
    "style": "OpenELM remote code (layer-wise num_query_heads/num_kv_heads, qkv_proj reshaped to (q+k+v) heads and split on dim 1, OpenELMRMSNorm q_norm/k_norm, OpenELMRotaryEmbedding(query, key), repeat_interleave, SDPA with additive mask)",
}

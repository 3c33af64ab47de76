"""Apple OpenELM (modeling_openelm.py) with layer-wise scaling of heads and FFN width.

transformer.token_embeddings, transformer.layers.N.attn (OpenELMMultiHeadCausalAttention:
qkv_proj viewed (b, s, q_heads + 2 kv_heads, hd) and split, q_norm/k_norm RMSNorm per head before
the rotary, pos_embedding = OpenELMRotaryEmbedding (rotate_half, cos/sin caches laid out as
cat(freqs, freqs)), repeat_interleave GQA, SDPA is_causal, out_proj), attn_norm/ffn_norm RMSNorm,
GLU ffn proj_1/proj_2, shared input/output embeddings.  Heads per layer: q 4/4/6, kv 1/2/2.
Slip: layer 1 is built with config.rope_kernel = "pairs": it rotates adjacent pairs
(rotate_every_two) with the same halves-laid-out cos/sin caches.  No cache.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": [
        "transformer.layers.0.attn",
        "transformer.layers.1.attn",
        "transformer.layers.2.attn",
    ],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "transformer.layers.1.attn",
    "stage": "rotated_queries",
    "mistake": "rope_pairing",
    "style": "OpenELM: layer-wise num_query_heads 4/4/6 and num_kv_heads 1/2/2 (head_dim 16), fused qkv_proj split by heads, "
    "per-head RMSNorm q_norm/k_norm, rotate_half rotary (freq_constant 10000), repeat_interleave, SDPA; slip: layer 1 "
    "rotates adjacent pairs with the halves tables",
}


class OpenELMConfig:
    vocab_size = 140
    model_dim = 64
    head_dim = 16
    num_transformer_layers = 3
    num_query_heads = [4, 4, 6]
    num_kv_heads = [1, 2, 2]
    ffn_multipliers = [1.0, 1.5, 2.0]
    ffn_dim_divisor = 16
    rope_freq_constant = 10000
    rope_max_length = 64
    rope_kernel = ["halves", "pairs", "halves"]


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


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotate_every_two(x):
    x1 = x[..., ::2]
    x2 = x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


class OpenELMRotaryEmbedding(nn.Module):
    def __init__(self, model_dim, max_seq_length, freq_constant=10000, kernel="halves"):
        super().__init__()
        inv_freq = 1.0 / (
            freq_constant ** (torch.arange(0, model_dim, 2, dtype=torch.float32) / model_dim)
        )
        self.model_dim = model_dim
        self.kernel = kernel
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        pos_index = torch.arange(max_seq_length, dtype=torch.float32)
        pos_index_theta = torch.einsum("i,j->ij", pos_index, inv_freq)
        emb = torch.cat((pos_index_theta, pos_index_theta), dim=-1)
        self.register_buffer("_cached_cos", emb.cos()[None, None, :, :], persistent=False)
        self.register_buffer("_cached_sin", emb.sin()[None, None, :, :], persistent=False)

    def _apply_rotary_pos_emb(self, x, pos_sin, pos_cos):
        rotate = _rotate_half if self.kernel == "halves" else _rotate_every_two
        return (x * pos_cos) + (rotate(x) * pos_sin)

    def forward(self, query, key):
        dim = key.shape[-1]
        key_len = key.shape[2]
        query_len = query.shape[2]
        cos = self._cached_cos[..., :key_len, :].to(query.dtype)
        sin = self._cached_sin[..., :key_len, :].to(query.dtype)
        query = self._apply_rotary_pos_emb(
            query,
            sin[..., key_len - query_len : key_len, :],
            cos[..., key_len - query_len : key_len, :],
        )
        key = self._apply_rotary_pos_emb(key, sin, cos)
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
            head_dim,
            config.rope_max_length,
            config.rope_freq_constant,
            kernel=config.rope_kernel[layer_idx],
        )
        self.q_norm = OpenELMRMSNorm(head_dim)
        self.k_norm = OpenELMRMSNorm(head_dim)
        self.out_proj = nn.Linear(q_heads * head_dim, config.model_dim, bias=False)
        self.head_dim = head_dim
        self.num_q_heads = q_heads
        self.num_k_heads = k_heads
        self.num_v_heads = v_heads
        self.num_groups = q_heads // k_heads

    def forward(self, hidden_states):
        batch_size, seq_length, d_model = hidden_states.size()
        qkv = self.qkv_proj(hidden_states)
        qkv = qkv.reshape(
            batch_size,
            seq_length,
            self.num_q_heads + self.num_k_heads + self.num_v_heads,
            self.head_dim,
        )
        qkv = qkv.transpose(1, 2)
        queries, keys, values = qkv.split(
            [self.num_q_heads, self.num_k_heads, self.num_v_heads], dim=1
        )
        queries = self.q_norm(queries)
        keys = self.k_norm(keys)
        queries, keys = self.pos_embedding(queries, keys)
        if self.num_groups != 1:
            keys = keys.repeat_interleave(self.num_groups, dim=1)
            values = values.repeat_interleave(self.num_groups, dim=1)
        attn_output = F.scaled_dot_product_attention(queries, keys, values, is_causal=True)
        attn_output = attn_output.transpose(1, 2).contiguous()
        attn_output = attn_output.reshape(batch_size, seq_length, self.num_q_heads * self.head_dim)
        return self.out_proj(attn_output)


def make_divisible(v, divisor=8):
    new_v = max(divisor, int(v + divisor / 2) // divisor * divisor)
    if new_v < 0.9 * v:
        new_v += divisor
    return new_v


class OpenELMFeedForwardNetwork(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        ffn_dim = make_divisible(
            config.ffn_multipliers[layer_idx] * config.model_dim, config.ffn_dim_divisor
        )
        self.proj_1 = nn.Linear(config.model_dim, 2 * ffn_dim, bias=False)
        self.proj_2 = nn.Linear(ffn_dim, config.model_dim, bias=False)
        self.ffn_dim = ffn_dim

    def forward(self, x):
        y_12 = self.proj_1(x)
        y_1, y_2 = y_12.chunk(2, dim=-1)
        return self.proj_2(F.silu(y_1) * y_2)


class OpenELMDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.attn = OpenELMMultiHeadCausalAttention(config, layer_idx)
        self.ffn = OpenELMFeedForwardNetwork(config, layer_idx)
        self.ffn_norm = OpenELMRMSNorm(config.model_dim)
        self.attn_norm = OpenELMRMSNorm(config.model_dim)

    def forward(self, hidden_states):
        hidden_states = hidden_states + self.attn(self.attn_norm(hidden_states))
        return hidden_states + self.ffn(self.ffn_norm(hidden_states))


class OpenELMModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.token_embeddings = nn.Embedding(config.vocab_size, config.model_dim)
        self.layers = nn.ModuleList(
            [OpenELMDecoderLayer(config, i) for i in range(config.num_transformer_layers)]
        )
        self.norm = OpenELMRMSNorm(config.model_dim)

    def forward(self, input_ids):
        h = self.token_embeddings(input_ids)
        for layer in self.layers:
            h = layer(h)
        return self.norm(h)


class OpenELMForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.transformer = OpenELMModel(config)

    def forward(self, input_ids):
        h = self.transformer(input_ids)
        return F.linear(h, self.transformer.token_embeddings.weight)


def make_model():
    torch.manual_seed(707)
    model = OpenELMForCausalLM(OpenELMConfig())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Linear):
                m.weight.normal_(0.0, 0.1)
            elif isinstance(m, nn.Embedding):
                m.weight.normal_(0.0, 0.5)
            elif isinstance(m, OpenELMRMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn_like(m.weight))
    return model.eval()

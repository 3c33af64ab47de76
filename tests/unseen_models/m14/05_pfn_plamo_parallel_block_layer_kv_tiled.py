"""Preferred Networks PLaMo-13B remote code (modeling_plamo.py), reduced.

PlamoForCausalLM: model (PlamoModel: embed_tokens, layers = PlamoDecoder whose own `layers` is the
ModuleList, norm) and lm_head.  PlamoDecoderLayer is a *parallel* block: one `norm` (RMSNorm), then
hidden + self_attn(h) + mlp(h).  PlamoAttention: q_proj/k_proj/v_proj/o_proj without bias, shared
key/value heads (`n_shared_head` = 2 query heads per kv head: GQA 4/2), RotaryEmbedding with cos/sin
tables (rotate_half layout, base 1e4, float64 then cast), `_expand_kv` broadcasting each kv head to its
group (x[:, :, None].expand(...).reshape), additive causal mask, softmax.
Slip: layer 2 was switched to a "fast path" `_expand_kv_tiled` that uses `.repeat(1, n_shared_head, 1, 1)`:
the kv heads are tiled (query head h reads kv head h % kv_heads instead of h // 2).
No cache.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": [
        "model.layers.layers.0.self_attn",
        "model.layers.layers.1.self_attn",
        "model.layers.layers.2.self_attn",
    ],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "model.layers.layers.2.self_attn",
    "stage": "scores",
    "mistake": "kv_group_mapping",
    "style": "PLaMo-13B modeling_plamo.py: PlamoDecoder.layers nesting, parallel block with one norm, n_shared_head "
    "GQA 4/2, rotate_half base 1e4; layer 2 expands kv with .repeat (tiled) instead of _expand_kv",
}


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, max_position_embeddings=128, base=10000):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        t = torch.arange(max_position_embeddings, dtype=torch.float64)
        freqs = torch.einsum("i,j->ij", t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos_cached = emb.cos()[None, None]
        self.sin_cached = emb.sin()[None, None]

    def forward(self, x, seq_len):
        return self.cos_cached[:, :, :seq_len].to(x.dtype), self.sin_cached[:, :, :seq_len].to(x.dtype)


def _rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def _rotary_pos_emb(x, cos, sin, position_ids):
    cos = cos.squeeze(1).squeeze(0)[position_ids].unsqueeze(1)
    sin = sin.squeeze(1).squeeze(0)[position_ids].unsqueeze(1)
    return (x * cos) + (_rotate_half(x) * sin)


def _expand_kv(x, n_shared_head):
    b, kv, s, d = x.shape
    return x[:, :, None].expand(b, kv, n_shared_head, s, d).reshape(b, kv * n_shared_head, s, d)


def _expand_kv_tiled(x, n_shared_head):
    return x.repeat(1, n_shared_head, 1, 1)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * hidden_states * torch.rsqrt(variance + self.variance_epsilon)


class PlamoAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.head_dim = self.hidden_size // config.num_attention_heads
        self.q_num_heads = config.num_attention_heads
        self.qk_dim = self.v_dim = self.head_dim
        self.n_shared_head = config.n_shared_head
        self.k_num_heads = self.q_num_heads // self.n_shared_head
        self.v_num_heads = self.k_num_heads
        self.q_proj = nn.Linear(self.hidden_size, self.q_num_heads * self.qk_dim, bias=False)
        self.k_proj = nn.Linear(self.hidden_size, self.k_num_heads * self.qk_dim, bias=False)
        self.v_proj = nn.Linear(self.hidden_size, self.v_num_heads * self.v_dim, bias=False)
        self.o_proj = nn.Linear(self.q_num_heads * self.v_dim, self.hidden_size, bias=False)
        self.rotary_emb = RotaryEmbedding(self.qk_dim, base=config.rope_theta)
        self.expand = _expand_kv_tiled if layer_idx in config.fast_expand_layers else _expand_kv

    def forward(self, hidden_states, attention_mask, position_ids):
        bsz, q_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states).view(bsz, q_len, self.q_num_heads, self.qk_dim).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(bsz, q_len, self.k_num_heads, self.qk_dim).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(bsz, q_len, self.v_num_heads, self.v_dim).transpose(1, 2)
        cos, sin = self.rotary_emb(value_states, seq_len=q_len)
        query_states = _rotary_pos_emb(query_states, cos, sin, position_ids)
        key_states = _rotary_pos_emb(key_states, cos, sin, position_ids)
        key_states = self.expand(key_states, self.n_shared_head)
        value_states = self.expand(value_states, self.n_shared_head)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(self.qk_dim)
        attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, self.q_num_heads * self.v_dim)
        return self.o_proj(attn_output)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class PlamoDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = PlamoAttention(config, layer_idx)
        self.mlp = MLP(config)
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask, position_ids):
        residual = hidden_states
        hidden_states = self.norm(hidden_states)
        h1 = self.self_attn(hidden_states, attention_mask, position_ids)
        h2 = self.mlp(hidden_states)
        return residual + h1 + h2


class PlamoDecoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList(PlamoDecoderLayer(config, i) for i in range(config.num_hidden_layers))

    def forward(self, hidden_states, attention_mask, position_ids):
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask, position_ids)
        return hidden_states


class PlamoModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = PlamoDecoder(config)
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids):
        bsz, seq_len = input_ids.shape
        h = self.embed_tokens(input_ids)
        position_ids = torch.arange(seq_len)[None].expand(bsz, -1)
        mask = torch.full((seq_len, seq_len), torch.finfo(h.dtype).min, dtype=h.dtype).triu(1)[None, None]
        return self.norm(self.layers(h, mask, position_ids))


class PlamoForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = PlamoModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids):
        return self.lm_head(self.model(input_ids))


class PlamoConfig:
    vocab_size = 96
    hidden_size = 64
    intermediate_size = 160
    num_hidden_layers = 3
    num_attention_heads = 4
    n_shared_head = 2
    rope_theta = 10000
    rms_norm_eps = 1e-6
    fast_expand_layers = (2,)


def make_model():
    torch.manual_seed(1405)
    model = PlamoForCausalLM(PlamoConfig())
    g = torch.Generator().manual_seed(14051)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

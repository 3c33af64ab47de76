"""Index-1.9B (bilibili, IndexForCausalLM remote code) as a small llama-shaped decoder.

IndexForCausalLM: model (IndexModel: embed_tokens, layers.N, norm) and lm_head = NormHead (rows of the
weight L2-normalised, then a fixed logit scale).  IndexDecoderLayer: pre-RMSNorm attention and SwiGLU
MLP with residuals.  IndexAttention: q/k/v/o_proj without bias, 4 heads (kv 4), rotate_half rotary
(base 1e4, cos/sin from position_ids in float64 at call time), matmul / sqrt(head_dim), additive
finfo.min causal mask with the past columns visible, softmax, matmul, o_proj.
Cache: hf legacy tuples: `out = model(ids, use_cache=True)`, then
`model(tok, past_key_values=out.past_key_values, use_cache=True)`; logits in `out.logits`; each entry
(k, v), (b, 4, T, 16), keys rotated.
Slip: layer 2 projects its values with k_proj's weights.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["model.layers.0.self_attn", "model.layers.1.self_attn", "model.layers.2.self_attn"],
    "kind": "causal-multihead",
    "cache": "hf",
    "layer": "model.layers.2.self_attn",
    "stage": "values",
    "mistake": "wrong_projection",
    "style": "Index-1.9B (bilibili IndexForCausalLM): llama attention (no bias, MHA 4/4, rotate_half "
    "1e4), legacy (k, v) tuples, NormHead lm head; slip: layer 2 projects its values with "
    "k_proj",
}


class IndexRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class IndexRotaryEmbedding(nn.Module):
    def __init__(self, dim, base=10000.0):
        super().__init__()
        self.dim = dim
        self.base = base

    def forward(self, x, position_ids):
        inv_freq = 1.0 / (
            self.base
            ** (torch.arange(0, self.dim, 2, dtype=torch.float64, device=x.device) / self.dim)
        )
        freqs = position_ids.to(torch.float64)[..., None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class IndexAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.values_from_k_proj = layer_idx in config.values_from_k_proj_layers
        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(
            self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False
        )
        self.v_proj = nn.Linear(
            self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False
        )
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=False)
        self.rotary_emb = IndexRotaryEmbedding(self.head_dim, base=config.rope_theta)

    def forward(
        self, hidden_states, attention_mask, position_ids, past_key_value=None, use_cache=False
    ):
        bsz, q_len, _ = hidden_states.size()
        q = (
            self.q_proj(hidden_states)
            .view(bsz, q_len, self.num_heads, self.head_dim)
            .transpose(1, 2)
        )
        k = (
            self.k_proj(hidden_states)
            .view(bsz, q_len, self.num_key_value_heads, self.head_dim)
            .transpose(1, 2)
        )
        v_lin = self.k_proj if self.values_from_k_proj else self.v_proj
        v = (
            v_lin(hidden_states)
            .view(bsz, q_len, self.num_key_value_heads, self.head_dim)
            .transpose(1, 2)
        )
        cos, sin = self.rotary_emb(v, position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if past_key_value is not None:
            k = torch.cat([past_key_value[0], k], dim=2)
            v = torch.cat([past_key_value[1], v], dim=2)
        present = (k, v) if use_cache else None
        k = torch.repeat_interleave(k, self.num_key_value_groups, dim=1)
        v = torch.repeat_interleave(v, self.num_key_value_groups, dim=1)
        attn_weights = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.head_dim)
        attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, v)
        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, self.hidden_size)
        return self.o_proj(attn_output), present


class IndexMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class IndexDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = IndexAttention(config, layer_idx)
        self.mlp = IndexMLP(config)
        self.input_layernorm = IndexRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = IndexRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask, position_ids, past_key_value, use_cache):
        attn_out, present = self.self_attn(
            self.input_layernorm(hidden_states),
            attention_mask,
            position_ids,
            past_key_value,
            use_cache,
        )
        hidden_states = hidden_states + attn_out
        hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states, present


def build_causal_mask(q_len, past_len, dtype, device):
    neg = torch.finfo(dtype).min
    mask = torch.triu(torch.full((q_len, q_len), neg, dtype=dtype, device=device), diagonal=1)
    if past_len > 0:
        past = torch.zeros(q_len, past_len, dtype=dtype, device=device)
        mask = torch.cat([past, mask], dim=-1)
    return mask[None, None]


class IndexModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [IndexDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = IndexRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        bsz, q_len = input_ids.shape
        past_len = past_key_values[0][0].shape[2] if past_key_values is not None else 0
        position_ids = torch.arange(past_len, past_len + q_len, device=input_ids.device)[
            None
        ].expand(bsz, -1)
        hidden_states = self.embed_tokens(input_ids)
        mask = build_causal_mask(q_len, past_len, hidden_states.dtype, input_ids.device)
        next_cache = ()
        for i, layer in enumerate(self.layers):
            past = past_key_values[i] if past_key_values is not None else None
            hidden_states, present = layer(hidden_states, mask, position_ids, past, use_cache)
            next_cache += (present,)
        return self.norm(hidden_states), (next_cache if use_cache else None)


class NormHead(nn.Module):
    """Index's lm head: the weight rows are L2-normalised before the projection."""

    def __init__(self, hidden_size, vocab_size):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab_size, hidden_size) / math.sqrt(hidden_size))

    def forward(self, hidden_states):
        return F.linear(hidden_states, F.normalize(self.weight, dim=-1)) * 8.0


class IndexForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = IndexModel(config)
        self.lm_head = NormHead(config.hidden_size, config.vocab_size)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        hidden, cache = self.model(input_ids, past_key_values=past_key_values, use_cache=use_cache)
        return SimpleNamespace(logits=self.lm_head(hidden), past_key_values=cache)


def make_model():
    torch.manual_seed(3607)
    config = SimpleNamespace(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        values_from_k_proj_layers=[2],
    )
    model = IndexForCausalLM(config)
    g = torch.Generator().manual_seed(3607 * 10 + 1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, IndexRMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

"""Baidu ERNIE 4.5 dense decoder after transformers' modeling_ernie4_5.py (small, random weights).

Ernie4_5ForCausalLM: model (embed_tokens, layers.N, norm, rotary_emb), lm_head.  Ernie4_5Attention:
q/k/v/o without bias (use_bias False), GQA 4/2, rotary on interleaved pairs (x[2i], x[2i+1]) with
cos/sin tables whose halves are `repeat_interleave(2)`-ed, base 5e5, eager matmul * scaling,
finfo.min additive causal mask, softmax upcast to at least float32.  SiLU-gated MLP, RMSNorm with gain.
Slip: layer 2 is an `Ernie4_5RightAlignedAttention` left over from a right-aligned (left padding)
experiment: it recomputes its own position ids as `seq_len - 1 - position_ids`, so both queries and
keys are rotated at positions n-1 .. 0 instead of 0 .. n-1 (relative distances change sign).
No cache.
"""

from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": [
        "model.layers.0.self_attn",
        "model.layers.1.self_attn",
        "model.layers.2.self_attn",
    ],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "model.layers.2.self_attn",
    "stage": "rotated_queries",
    "mistake": "rope_positions",
    "style": "modeling_ernie4_5.py: interleaved rotary (repeat_interleave tables, even/odd rotate) base 5e5, GQA 4/2, "
    "no bias; layer 2 rotates queries and keys at reversed positions n-1..0",
}


class Ernie4_5RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


class Ernie4_5RotaryEmbedding(nn.Module):
    def __init__(self, head_dim, base):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x, position_ids):
        freqs = position_ids[..., None].to(torch.float64) * self.inv_freq.to(torch.float64)
        return freqs.cos().to(x.dtype), freqs.sin().to(x.dtype)


def rotate_half_interleaved(x):
    x1 = x[..., 0::2]
    x2 = x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rotary_pos_emb(q, k, cos, sin):
    cos = cos.repeat_interleave(2, dim=-1).unsqueeze(1)
    sin = sin.repeat_interleave(2, dim=-1).unsqueeze(1)
    return q * cos + rotate_half_interleaved(q) * sin, k * cos + rotate_half_interleaved(k) * sin


def repeat_kv(x, n_rep):
    b, kv, s, d = x.shape
    return x[:, :, None].expand(b, kv, n_rep, s, d).reshape(b, kv * n_rep, s, d)


class Ernie4_5Attention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=config.use_bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.use_bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.use_bias)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=config.use_bias)
        self.rotary_emb = Ernie4_5RotaryEmbedding(config.head_dim, config.rope_theta)

    def _position_ids(self, position_ids):
        return position_ids

    def forward(self, hidden_states, position_ids, attention_mask=None):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = self.rotary_emb(hidden_states, self._position_ids(position_ids))
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k = repeat_kv(k, self.num_key_value_groups)
        v = repeat_kv(v, self.num_key_value_groups)
        w = torch.matmul(q, k.transpose(2, 3)) * self.scaling
        if attention_mask is not None:
            w = w + attention_mask
        w = F.softmax(w, dim=-1, dtype=torch.promote_types(q.dtype, torch.float32)).to(q.dtype)
        out = torch.matmul(w, v).transpose(1, 2).reshape(*input_shape, -1)
        return self.o_proj(out), w


class Ernie4_5RightAlignedAttention(Ernie4_5Attention):
    def _position_ids(self, position_ids):
        return position_ids.shape[-1] - 1 - position_ids


class Ernie4_5MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Ernie4_5DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        cls = Ernie4_5RightAlignedAttention if layer_idx == config.right_aligned_layer else Ernie4_5Attention
        self.self_attn = cls(config, layer_idx)
        self.mlp = Ernie4_5MLP(config)
        self.input_layernorm = Ernie4_5RMSNorm(config.hidden_size)
        self.post_attention_layernorm = Ernie4_5RMSNorm(config.hidden_size)

    def forward(self, hidden_states, position_ids, attention_mask):
        h, _ = self.self_attn(self.input_layernorm(hidden_states), position_ids, attention_mask=attention_mask)
        hidden_states = hidden_states + h
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class Ernie4_5Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([Ernie4_5DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = Ernie4_5RMSNorm(config.hidden_size)

    def forward(self, input_ids):
        b, t = input_ids.shape
        h = self.embed_tokens(input_ids)
        position_ids = torch.arange(t, device=h.device)[None].expand(b, -1)
        mask = torch.zeros(t, t, dtype=h.dtype, device=h.device)
        mask = mask.masked_fill(torch.ones(t, t, dtype=torch.bool, device=h.device).triu(1), torch.finfo(h.dtype).min)
        for layer in self.layers:
            h = layer(h, position_ids, mask[None, None])
        return self.norm(h)


class Ernie4_5ForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = Ernie4_5Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids):
        return SimpleNamespace(logits=self.lm_head(self.model(input_ids)))


def make_model():
    torch.manual_seed(906)
    config = SimpleNamespace(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=500000.0,
                             use_bias=False, right_aligned_layer=2)
    model = Ernie4_5ForCausalLM(config)
    g = torch.Generator().manual_seed(9061)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, Ernie4_5RMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

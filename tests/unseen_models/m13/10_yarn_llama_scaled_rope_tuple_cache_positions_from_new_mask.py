"""jquesnelle/yarn scaled_rope modeling_llama_yarn.py style (LlamaYaRNScaledRotaryEmbedding), reduced.

LlamaForCausalLM: model (embed_tokens, layers.N = LlamaDecoderLayer, norm) and lm_head.  LlamaAttention:
q/k/v/o bias-free, GQA 4/2 (repeat_kv), rotary with YaRN frequencies (scale 4, original context 16,
beta_fast 32, beta_slow 1, base 1e4; the find_correction_range linear ramp blends interpolated and
extrapolated inverse frequencies).  attn_factor is set to 1/_yarn_get_mscale(4) so the cos/sin tables
carry mscale 1 (a pure rotation).  Eager matmul attention with a finfo.min causal mask built from
past_key_values_length.
Cache: hf tuples.  `out = model(ids, use_cache=True)`, `model(tok, past_key_values=out.past_key_values,
use_cache=True)`; logits in `out.logits`; past is a tuple of per-layer `(k, v)` (b, kv, s, d), cat on
dim 2.
Slip: position_ids are derived as `attention_mask.long().cumsum(-1) - 1` from a default attention mask
of ones over the *new* tokens only (the padding-aware path of the repo's generation helper), so a
decoded token is rotated as position 0.  The causal mask and kv lengths are right; full forward and
prompt pass are exact.
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
    "decode": {"mistake": "cache_positions", "step": 0, "layer": "model.layers.0.self_attn"},
    "style": "yarn repo LlamaYaRNScaledRotaryEmbedding (ramp-blended inv_freq, mscale folded to 1), GQA 4/2, legacy "
    "(k, v) tuples; decode positions from cumsum of a mask over the new tokens only",
}


def _yarn_find_correction_dim(num_rotations, dim, base, max_pos):
    return (dim * math.log(max_pos / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def _yarn_find_correction_range(low_rot, high_rot, dim, base, max_pos):
    low = math.floor(_yarn_find_correction_dim(low_rot, dim, base, max_pos))
    high = math.ceil(_yarn_find_correction_dim(high_rot, dim, base, max_pos))
    return max(low, 0), min(high, dim - 1)


def _yarn_linear_ramp_mask(lo, hi, dim):
    if lo == hi:
        hi += 0.001
    return torch.clamp((torch.arange(dim, dtype=torch.float64) - lo) / (hi - lo), 0, 1)


def _yarn_get_mscale(scale=1):
    return 1.0 if scale <= 1 else 0.1 * math.log(scale) + 1.0


class LlamaYaRNScaledRotaryEmbedding(nn.Module):
    def __init__(self, dim, base=10000, scale=4, original_max_position_embeddings=16, beta_fast=32, beta_slow=1):
        super().__init__()
        self.dim, self.base, self.scale = dim, base, scale
        pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        inv_freq_extrapolation = 1.0 / pos_freqs
        inv_freq_interpolation = 1.0 / (scale * pos_freqs)
        low, high = _yarn_find_correction_range(beta_fast, beta_slow, dim, base, original_max_position_embeddings)
        inv_freq_mask = 1 - _yarn_linear_ramp_mask(low, high, dim // 2)
        self.inv_freq = inv_freq_interpolation * (1 - inv_freq_mask) + inv_freq_extrapolation * inv_freq_mask
        attn_factor = 1.0 / _yarn_get_mscale(scale)
        self.mscale = float(_yarn_get_mscale(scale) * attn_factor)

    def forward(self, x, position_ids):
        freqs = position_ids[..., None].double() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.mscale).to(x.dtype), (emb.sin() * self.mscale).to(x.dtype)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def repeat_kv(x, n_rep):
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


class LlamaAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)
        self.rotary_emb = LlamaYaRNScaledRotaryEmbedding(self.head_dim)

    def forward(self, hidden_states, attention_mask, position_ids, past_key_value=None, use_cache=False):
        bsz, q_len, _ = hidden_states.size()
        q = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary_emb(v, position_ids)
        cos, sin = cos[:, None], sin[:, None]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if past_key_value is not None:
            k = torch.cat([past_key_value[0], k], dim=2)
            v = torch.cat([past_key_value[1], v], dim=2)
        present = (k, v) if use_cache else None
        k = repeat_kv(k, self.num_key_value_groups)
        v = repeat_kv(v, self.num_key_value_groups)
        attn_weights = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.head_dim)
        attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, v).transpose(1, 2).reshape(bsz, q_len, -1)
        return self.o_proj(attn_output), present


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = LlamaAttention(config)
        h, i = config.hidden_size, config.intermediate_size
        self.mlp = nn.ModuleDict(dict(gate_proj=nn.Linear(h, i, bias=False), up_proj=nn.Linear(h, i, bias=False),
                                      down_proj=nn.Linear(i, h, bias=False)))
        self.input_layernorm = LlamaRMSNorm(h)
        self.post_attention_layernorm = LlamaRMSNorm(h)

    def forward(self, hidden_states, attention_mask, position_ids, past_key_value=None, use_cache=False):
        a, present = self.self_attn(self.input_layernorm(hidden_states), attention_mask, position_ids,
                                    past_key_value, use_cache)
        hidden_states = hidden_states + a
        x = self.post_attention_layernorm(hidden_states)
        m = self.mlp
        hidden_states = hidden_states + m["down_proj"](F.silu(m["gate_proj"](x)) * m["up_proj"](x))
        return hidden_states, present


class LlamaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = LlamaRMSNorm(config.hidden_size)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        bsz, seq_length = input_ids.shape
        past_len = past_key_values[0][0].shape[2] if past_key_values is not None else 0
        attention_mask = torch.ones(bsz, seq_length, dtype=torch.long, device=input_ids.device)
        position_ids = attention_mask.long().cumsum(-1) - 1
        inputs_embeds = self.embed_tokens(input_ids)
        dtype = inputs_embeds.dtype
        q_pos = torch.arange(past_len, past_len + seq_length, device=input_ids.device)
        k_pos = torch.arange(past_len + seq_length, device=input_ids.device)
        causal = torch.zeros(seq_length, past_len + seq_length, dtype=dtype, device=input_ids.device)
        causal = causal.masked_fill(k_pos[None] > q_pos[:, None], torch.finfo(dtype).min)[None, None]
        h = inputs_embeds
        presents = () if use_cache else None
        for i, layer in enumerate(self.layers):
            h, present = layer(h, causal, position_ids,
                               past_key_values[i] if past_key_values is not None else None, use_cache)
            if use_cache:
                presents = presents + (present,)
        return self.norm(h), presents


class LlamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        h, presents = self.model(input_ids, past_key_values, use_cache)
        return SimpleNamespace(logits=self.lm_head(h), past_key_values=presents)


def make_model():
    torch.manual_seed(1310)
    config = SimpleNamespace(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LlamaRMSNorm):
                m.weight.copy_(1.0 + 0.2 * torch.randn_like(m.weight))
    return model.eval()

"""Nanbeige (Nanbeige-16B remote code, modeling_nanbeige.py, a Llama-1-era HF layout) in plain torch.

NanbeigeForCausalLM: `model.embed_tokens`, `model.layers.N` (`input_layernorm`, `self_attn`,
`post_attention_layernorm`, `mlp`), `model.norm`, `lm_head`.  NanbeigeAttention: q/k/v/o without bias,
MHA 4x16, `rotary_emb` with `cos_cached`/`sin_cached` built in float64 and gathered at `position_ids`
(rotate_half, base 1e4), legacy `past_key_value` tuples (k, v) of shape (b, h, s, d) concatenated on
dim 2, `_prepare_decoder_attention_mask` with the past columns visible (finfo.min fill), matmul /
sqrt(head_dim), float32 softmax.
Cache: hf tuples: `out = model(ids, use_cache=True)`, then
`model(tok, past_key_values=out.past_key_values, use_cache=True)`; logits in `out.logits`.
Slip: the attention returns `past_key_value = (value_states, key_states)` (the order of an internal
"vk" layout kept from a fused kernel), so on the next step the cached values are read as keys and the
cached keys as values.  Full forward and prompt pass are exact.
"""

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
    "decode": {
        "mistake": "cache_other",
        "step": 0,
        "layer": "model.layers.0.self_attn",
    },
    "style": "Nanbeige modeling_nanbeige.py (Llama-1-era HF): cos_cached/sin_cached by position_ids, "
    "_prepare_decoder_attention_mask, legacy (k, v) tuples (b, h, s, d); slip: present stored as (v, k)",
}


class NanbeigeRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * hidden_states * torch.rsqrt(variance + self.variance_epsilon)


class NanbeigeRotaryEmbedding(nn.Module):
    def __init__(self, dim, max_position_embeddings=64, base=10000.0):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        t = torch.arange(max_position_embeddings, dtype=torch.float64)
        emb = torch.cat((torch.outer(t, inv_freq),) * 2, dim=-1)
        self.cos_cached = emb.cos()  # plain attributes: stay float64, cast at use
        self.sin_cached = emb.sin()

    def forward(self, x, seq_len):
        return self.cos_cached[:seq_len].to(x.dtype), self.sin_cached[:seq_len].to(x.dtype)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids):
    cos = cos[position_ids].unsqueeze(1)
    sin = sin[position_ids].unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class NanbeigeAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.hidden_size, self.num_heads = config.hidden_size, config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.q_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=False)
        self.k_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=False)
        self.v_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=False)
        self.o_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=False)
        self.rotary_emb = NanbeigeRotaryEmbedding(self.head_dim, config.max_position_embeddings, config.rope_theta)

    def forward(self, hidden_states, attention_mask, position_ids, past_key_value=None, use_cache=False):
        bsz, q_len, _ = hidden_states.size()
        q = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        kv_seq_len = q_len + (past_key_value[0].shape[-2] if past_key_value is not None else 0)
        cos, sin = self.rotary_emb(v, seq_len=kv_seq_len)
        q, k = apply_rotary_pos_emb(q, k, cos, sin, position_ids)
        if past_key_value is not None:
            k = torch.cat([past_key_value[0], k], dim=2)
            v = torch.cat([past_key_value[1], v], dim=2)
        past_key_value = (v, k) if use_cache else None
        attn_weights = torch.matmul(q, k.transpose(2, 3)) / (self.head_dim**0.5)
        attn_weights = attn_weights + attention_mask
        if attn_weights.dtype != torch.float64:
            attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(q.dtype)
        else:
            attn_weights = F.softmax(attn_weights, dim=-1)
        out = torch.matmul(attn_weights, v).transpose(1, 2).reshape(bsz, q_len, self.hidden_size)
        return self.o_proj(out), past_key_value


class NanbeigeMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class NanbeigeDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = NanbeigeAttention(config)
        self.mlp = NanbeigeMLP(config)
        self.input_layernorm = NanbeigeRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = NanbeigeRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h, attention_mask, position_ids, past_key_value, use_cache):
        a, present = self.self_attn(self.input_layernorm(h), attention_mask, position_ids, past_key_value, use_cache)
        h = h + a
        return h + self.mlp(self.post_attention_layernorm(h)), present


class NanbeigeModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([NanbeigeDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = NanbeigeRMSNorm(config.hidden_size, config.rms_norm_eps)

    def _prepare_decoder_attention_mask(self, bsz, seq_len, past_len, dtype, device):
        mask = torch.full((seq_len, seq_len), torch.finfo(dtype).min, dtype=dtype, device=device).triu(1)
        if past_len > 0:
            mask = torch.cat([torch.zeros(seq_len, past_len, dtype=dtype, device=device), mask], dim=-1)
        return mask[None, None].expand(bsz, 1, seq_len, seq_len + past_len)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        bsz, seq_len = input_ids.shape
        past_len = past_key_values[0][0].shape[2] if past_key_values is not None else 0
        position_ids = torch.arange(past_len, past_len + seq_len, device=input_ids.device).unsqueeze(0)
        h = self.embed_tokens(input_ids)
        mask = self._prepare_decoder_attention_mask(bsz, seq_len, past_len, h.dtype, h.device)
        next_cache = ()
        for idx, layer in enumerate(self.layers):
            past = past_key_values[idx] if past_key_values is not None else None
            h, present = layer(h, mask, position_ids, past, use_cache)
            next_cache += (present,)
        return self.norm(h), (next_cache if use_cache else None)


class NanbeigeForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = NanbeigeModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        h, cache = self.model(input_ids, past_key_values=past_key_values, use_cache=use_cache)
        return SimpleNamespace(logits=self.lm_head(h), past_key_values=cache)


def make_model():
    torch.manual_seed(2013)
    config = SimpleNamespace(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                             num_attention_heads=4, max_position_embeddings=64, rope_theta=10000.0, rms_norm_eps=1e-6)
    model = NanbeigeForCausalLM(config)
    g = torch.Generator().manual_seed(20131)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, NanbeigeRMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

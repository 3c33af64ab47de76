"""Upstage Solar Pro remote code (modeling_solar.py) in plain torch.

SolarForCausalLM: `model.embed_tokens`, `model.layers.N` (SolarDecoderLayer: `input_layernorm`,
`self_attn`, `post_attention_layernorm`, `mlp`), `model.norm`, `lm_head`.  What makes Solar Pro
different from a Llama is the block skip connection ("bskcn"): the hidden state entering the layers
listed in `bskcn_1` is kept, and before each layer listed in `bskcn_2` the running hidden state is
mixed with it, `h * tv + kept * (1 - tv)` with the scalars `bskcn_tv`.  SolarAttention: q/k/v/o without
bias, GQA 4/2 `repeat_kv`, rotate_half rotary base 1e4 from `inv_freq` gathered at `position_ids`,
eager matmul * scaling, finfo.min 4-D mask from `cache_position`, float32 softmax.
Cache: hf cache object (`SolarCache` with `update(k, v, layer_idx)`, (b, kv, s, d), cat on dim -2).
"""

from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": ["model.layers.0.self_attn", "model.layers.1.self_attn", "model.layers.2.self_attn",
               "model.layers.3.self_attn"],
    "kind": "causal-multihead",
    "cache": "hf",
    "style": "Upstage Solar Pro modeling_solar.py: bskcn block skip connections (kept at layer 0, mixed back "
    "before layer 3), GQA 4/2 repeat_kv, rotate_half base 1e4, eager finfo.min mask from cache_position, "
    "SolarCache object with update()",
}


class SolarCache:
    def __init__(self):
        self.key_cache, self.value_cache = [], []

    def get_seq_length(self, layer_idx=0):
        return 0 if len(self.key_cache) <= layer_idx else self.key_cache[layer_idx].shape[-2]

    def update(self, key_states, value_states, layer_idx):
        if len(self.key_cache) <= layer_idx:
            self.key_cache.append(key_states)
            self.value_cache.append(value_states)
        else:
            self.key_cache[layer_idx] = torch.cat([self.key_cache[layer_idx], key_states], dim=-2)
            self.value_cache[layer_idx] = torch.cat([self.value_cache[layer_idx], value_states], dim=-2)
        return self.key_cache[layer_idx], self.value_cache[layer_idx]


class SolarRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        dtype = hidden_states.dtype
        h = hidden_states.to(torch.float32) if dtype != torch.float64 else hidden_states
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(dtype)


class SolarRotaryEmbedding(nn.Module):
    def __init__(self, dim, base):
        super().__init__()
        self.dim, self.base = dim, base

    def forward(self, x, position_ids):
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2, dtype=torch.float64) / self.dim))
        freqs = position_ids.to(torch.float64)[..., None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def repeat_kv(hidden_states, n_rep):
    b, kv, s, d = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    return hidden_states[:, :, None].expand(b, kv, n_rep, s, d).reshape(b, kv * n_rep, s, d)


class SolarAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_value=None):
        bsz, q_len, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if past_key_value is not None:
            k, v = past_key_value.update(k, v, self.layer_idx)
        k = repeat_kv(k, self.num_key_value_groups)
        v = repeat_kv(v, self.num_key_value_groups)
        attn_weights = torch.matmul(q, k.transpose(2, 3)) * self.scaling
        attn_weights = attn_weights + attention_mask[:, :, :, : k.shape[-2]]
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32 if q.dtype != torch.float64 else q.dtype).to(q.dtype)
        attn_output = torch.matmul(attn_weights, v).transpose(1, 2).reshape(bsz, q_len, -1)
        return self.o_proj(attn_output)


class SolarMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SolarDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = SolarAttention(config, layer_idx)
        self.mlp = SolarMLP(config)
        self.input_layernorm = SolarRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = SolarRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_value):
        residual = hidden_states
        h = self.self_attn(self.input_layernorm(hidden_states), position_embeddings, attention_mask, past_key_value)
        hidden_states = residual + h
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class SolarModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([SolarDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = SolarRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = SolarRotaryEmbedding(config.hidden_size // config.num_attention_heads, config.rope_theta)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        inputs_embeds = self.embed_tokens(input_ids)
        bsz, seq_len = input_ids.shape
        if use_cache and past_key_values is None:
            past_key_values = SolarCache()
        past_seen = past_key_values.get_seq_length() if past_key_values is not None else 0
        cache_position = torch.arange(past_seen, past_seen + seq_len, device=input_ids.device)
        position_ids = cache_position.unsqueeze(0)
        dtype = inputs_embeds.dtype
        target_len = past_seen + seq_len
        causal = torch.full((seq_len, target_len), torch.finfo(dtype).min, dtype=dtype, device=input_ids.device)
        causal = causal * (torch.arange(target_len, device=input_ids.device) > cache_position.reshape(-1, 1))
        attention_mask = causal[None, None].expand(bsz, 1, -1, -1)
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        kept = None
        for idx, layer in enumerate(self.layers):
            if idx in self.config.bskcn_1:
                kept = hidden_states
            if idx in self.config.bskcn_2:
                tv = self.config.bskcn_tv[self.config.bskcn_2.index(idx)]
                hidden_states = hidden_states * tv + kept * (1.0 - tv)
            hidden_states = layer(hidden_states, position_embeddings, attention_mask,
                                  past_key_values if use_cache else None)
        return self.norm(hidden_states), (past_key_values if use_cache else None)


class SolarForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = SolarModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        hidden, cache = self.model(input_ids, past_key_values=past_key_values, use_cache=use_cache)
        return SimpleNamespace(logits=self.lm_head(hidden), past_key_values=cache)


def make_model():
    torch.manual_seed(2002)
    config = SimpleNamespace(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0,
                             rms_norm_eps=1e-6, bskcn_1=[0], bskcn_2=[3], bskcn_tv=[0.9])
    model = SolarForCausalLM(config)
    g = torch.Generator().manual_seed(20021)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, SolarRMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

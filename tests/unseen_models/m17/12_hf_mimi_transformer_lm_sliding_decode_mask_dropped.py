"""The Mimi codec's streaming transformer (transformers' modeling_mimi.py MimiTransformerModel) run as a
token LM: embed_tokens -> transformer -> lm_head (the codec's SEANet/conv/quantizer parts are not built).

transformer.layers.N = MimiTransformerLayer: input_layernorm (nn.LayerNorm) -> self_attn ->
self_attn_layer_scale (MimiLayerScale, per-channel `scale`) -> + residual; post_attention_layernorm ->
mlp (fc1, gelu, fc2) -> mlp_layer_scale -> + residual.  MimiAttention: q_proj/k_proj/v_proj/o_proj
without bias, MHA 4x16, rotate_half rotary (MimiRotaryEmbedding, inv_freq in float64 here) base 1e4
from position_ids = cache_position, matmul * scaling, additive finfo.min mask, softmax in float32.
Every layer uses a sliding window of 3 keys (config.sliding_window = 3): a query at position i sees
keys i-2..i.  Cache: hf, a cache object (`MimiCache`, update(k, v, layer_idx) concatenating on dim 2,
get_seq_length()): `out = model(ids, use_cache=True)`, then `model(tok, past_key_values=out.past_key_values,
use_cache=True)`; logits in `out.logits`.
Slip: `_update_causal_mask` returns None when the call has one token ("a single new token may see the
whole cache") -- true for full causal attention, but here it drops the sliding window on every decode
step: the new token sees all cached keys.  Visible at step 0 whenever the prompt has at least 3 tokens
(for prompts of 1 or 2 tokens, from the first step where more than 3 keys are cached).
"""

from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["transformer.layers.0.self_attn", "transformer.layers.1.self_attn", "transformer.layers.2.self_attn"],
    "kind": "causal-multihead",
    "cache": "hf",
    "decode": {"mistake": "cache_mask", "step": 0, "layer": "transformer.layers.0.self_attn"},
    "style": "modeling_mimi.py MimiTransformerModel as a token LM: LayerNorm pre-norm, MimiLayerScale on both "
    "branches, gelu fc1/fc2, rotate_half base 1e4, sliding window 3 on every layer, cache object with update(); "
    "one-token calls get no mask, so the window is dropped on decode",
}


class MimiCache:
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


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class MimiRotaryEmbedding(nn.Module):
    def __init__(self, dim, base):
        super().__init__()
        self.dim, self.base = dim, base

    def forward(self, x, position_ids):
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2, dtype=torch.float64) / self.dim))
        freqs = position_ids[:, :, None].to(torch.float64) * inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class MimiLayerScale(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.scale = nn.Parameter(torch.full((config.hidden_size,), config.layer_scale_initial_scale))

    def forward(self, x):
        return self.scale * x


class MimiMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class MimiAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.scaling = 1 / (self.head_dim**0.5)
        self.sliding_window = config.sliding_window
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.rotary_emb = MimiRotaryEmbedding(self.head_dim, config.rope_theta)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None):
        bsz, q_len, _ = hidden_states.size()
        q = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary_emb(v, position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        attn_weights = torch.matmul(q, k.transpose(2, 3)) * self.scaling
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask[:, :, :, : k.shape[-2]]
        sm = torch.float64 if q.dtype == torch.float64 else torch.float32
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=sm).to(q.dtype)
        attn_output = torch.matmul(attn_weights, v).transpose(1, 2).contiguous().view(bsz, q_len, -1)
        return self.o_proj(attn_output), attn_weights


class MimiTransformerLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = MimiAttention(config, layer_idx)
        self.mlp = MimiMLP(config)
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.self_attn_layer_scale = MimiLayerScale(config)
        self.mlp_layer_scale = MimiLayerScale(config)

    def forward(self, hidden_states, attention_mask, position_ids, past_key_values):
        residual = hidden_states
        hidden_states, _ = self.self_attn(
            self.input_layernorm(hidden_states), attention_mask, position_ids, past_key_values
        )
        hidden_states = residual + self.self_attn_layer_scale(hidden_states)
        residual = hidden_states
        hidden_states = self.mlp(self.post_attention_layernorm(hidden_states))
        return residual + self.mlp_layer_scale(hidden_states)


class MimiTransformerModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList([MimiTransformerLayer(config, i) for i in range(config.num_hidden_layers)])

    def _update_causal_mask(self, hidden_states, cache_position, kv_len):
        q_len = hidden_states.shape[1]
        if q_len == 1:
            return None  # a single new token may see the whole cache
        dtype = hidden_states.dtype
        kpos = torch.arange(kv_len)[None, :]
        qpos = cache_position[:, None]
        blocked = (kpos > qpos) | (kpos <= qpos - self.config.sliding_window)
        mask = torch.zeros(q_len, kv_len, dtype=dtype).masked_fill(blocked, torch.finfo(dtype).min)
        return mask[None, None].expand(hidden_states.shape[0], 1, -1, -1)

    def forward(self, hidden_states, past_key_values=None, use_cache=False):
        if use_cache and past_key_values is None:
            past_key_values = MimiCache()
        past_seen = past_key_values.get_seq_length() if past_key_values is not None else 0
        q_len = hidden_states.shape[1]
        cache_position = torch.arange(past_seen, past_seen + q_len)
        position_ids = cache_position[None].expand(hidden_states.shape[0], -1)
        causal_mask = self._update_causal_mask(hidden_states, cache_position, past_seen + q_len)
        for layer in self.layers:
            hidden_states = layer(hidden_states, causal_mask, position_ids, past_key_values)
        return hidden_states, (past_key_values if use_cache else None)


class MimiTokenLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.transformer = MimiTransformerModel(config)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        hidden, cache = self.transformer(self.embed_tokens(input_ids), past_key_values, use_cache)
        return SimpleNamespace(logits=self.lm_head(self.norm(hidden)), past_key_values=cache)


def make_model():
    torch.manual_seed(1712)
    config = SimpleNamespace(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        head_dim=16,
        sliding_window=3,
        rope_theta=10000.0,
        norm_eps=1e-5,
        layer_scale_initial_scale=0.5,
    )
    model = MimiTokenLM(config)
    g = torch.Generator().manual_seed(17121)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
            if isinstance(m, MimiLayerScale):
                m.scale.copy_(0.5 + 0.2 * torch.randn(m.scale.shape, generator=g))
    return model.eval()

"""A Qwen3-style causal LM as kvcache-ai/ktransformers runs it: injected attention over its StaticCache.

ktransformers keeps the Hugging Face module tree (model.embed_tokens, model.layers.N with
input_layernorm / self_attn / post_attention_layernorm / mlp, model.norm, lm_head) and injects its own
attention forward, which takes `cache_position` and writes through
`past_key_value.update(key_states, value_states, self.layer_idx, {"sin": sin, "cos": cos,
"cache_position": cache_position})`.  ktransformers.models.custom_cache.StaticCache (adapted from
transformers 4.41's StaticCache): per-layer key_cache / value_cache preallocated (max_batch_size,
kv_heads, max_cache_len, head_dim), written with index_copy_ along the sequence axis,
`get_seq_length()` = number of occupied slots of layer 0 (any non-zero in batch 0, head 0).
Qwen3 attention: q_proj/k_proj/v_proj/o_proj without bias, per-head q_norm / k_norm (RMSNorm over
head_dim, own weights) before the rotary, rotate_half base 1e6, GQA 4/2 with repeat_kv, scaling
head_dim ** -0.5; the mask is built over all max_cache_len slots: slot <= cache_position (finfo.min).
Cache (hf): the model creates a StaticCache (batch <= 4, 64 slots) when use_cache=True and none is
given, and derives cache_position from get_seq_length():
`out = model(prompt, use_cache=True)`, `model(tok, past_key_values=out.past_key_values, use_cache=True)`;
logits in `out.logits`.
"""

from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": [
        "model.layers.0.self_attn",
        "model.layers.1.self_attn",
        "model.layers.2.self_attn",
    ],
    "kind": "causal-multihead",
    "cache": "hf",
    "style": "ktransformers injected Qwen3 attention: per-head q_norm/k_norm before rotate_half rotary (1e6), GQA "
    "4/2, custom StaticCache (b, kv, 64, d) with index_copy_ at cache_position, occupied-slot get_seq_length, "
    "mask over all 64 slots",
}


class Qwen3RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class StaticCache:
    """ktransformers custom_cache.StaticCache, dense (non-paged) layout."""

    def __init__(self, config, max_batch_size, max_cache_len, device=None, dtype=torch.float32):
        self.max_batch_size = max_batch_size
        self.max_cache_len = max_cache_len
        self.head_dim = config.hidden_size // config.num_attention_heads
        cache_shape = (max_batch_size, config.num_key_value_heads, max_cache_len, self.head_dim)
        self.key_cache = []
        self.value_cache = []
        for _ in range(config.num_hidden_layers):
            self.key_cache.append(torch.zeros(cache_shape, dtype=dtype, device=device))
            self.value_cache.append(torch.zeros(cache_shape, dtype=dtype, device=device))

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        cache_position = cache_kwargs.get("cache_position")
        k_out = self.key_cache[layer_idx]
        v_out = self.value_cache[layer_idx]
        b = key_states.shape[0]
        k_out[:b].index_copy_(2, cache_position, key_states)
        v_out[:b].index_copy_(2, cache_position, value_states)
        return k_out[:b], v_out[:b]

    def get_seq_length(self, layer_idx=0):
        # occupied cache == any slot in the sequence axis holds a non-zero value
        return int(self.key_cache[layer_idx][0, 0].any(dim=-1).sum())

    def get_max_length(self):
        return self.max_cache_len


class Qwen3RotaryEmbedding(nn.Module):
    def __init__(self, dim, base=1000000.0):
        super().__init__()
        self.inv_freq64 = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))

    def forward(self, x, position_ids):
        freqs = position_ids.to(torch.float64)[..., None] * self.inv_freq64[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class KQwen3Attention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
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
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(self.head_dim, base=config.rope_theta)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None, cache_position=None):
        bsz, q_len, _ = hidden_states.size()
        if position_ids is None:
            position_ids = torch.arange(q_len, device=hidden_states.device)[None].expand(bsz, -1)
        hidden_shape = (bsz, q_len, -1, self.head_dim)
        query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

        cos, sin = self.rotary_emb(value_states, position_ids)
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        if past_key_value is not None:
            cache_kwargs = {"sin": sin, "cos": cos, "cache_position": cache_position}
            key_states, value_states = past_key_value.update(key_states, value_states, self.layer_idx, cache_kwargs)

        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.scaling
        if attention_mask is None:
            attention_mask = _causal_mask(q_len, key_states.shape[-2], position_ids[0], attn_weights.dtype, attn_weights.device)
        attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, -1)
        return self.o_proj(attn_output), attn_weights


def _causal_mask(q_len, target_length, cache_position, dtype, device):
    min_dtype = torch.finfo(dtype).min
    causal_mask = torch.full((q_len, target_length), fill_value=min_dtype, dtype=dtype, device=device)
    visible = torch.arange(target_length, device=device)[None, :] <= cache_position.reshape(-1, 1)
    causal_mask = causal_mask.masked_fill(visible, 0.0)
    return causal_mask[None, None]


class Qwen3MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = KQwen3Attention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask, position_ids, past_key_value, cache_position):
        residual = hidden_states
        hidden_states, _ = self.self_attn(
            self.input_layernorm(hidden_states), attention_mask=attention_mask, position_ids=position_ids,
            past_key_value=past_key_value, cache_position=cache_position,
        )
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class KQwen3Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([Qwen3DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        bsz, seq_len = input_ids.shape
        inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and past_key_values is None:
            past_key_values = StaticCache(self.config, max_batch_size=4, max_cache_len=64,
                                          device=input_ids.device, dtype=inputs_embeds.dtype)
        past_seen_tokens = past_key_values.get_seq_length() if past_key_values is not None else 0
        cache_position = torch.arange(past_seen_tokens, past_seen_tokens + seq_len, device=input_ids.device)
        position_ids = cache_position.unsqueeze(0).expand(bsz, -1)
        target_length = past_key_values.get_max_length() if past_key_values is not None else seq_len
        causal_mask = _causal_mask(seq_len, target_length, cache_position, inputs_embeds.dtype, input_ids.device)
        hidden_states = inputs_embeds
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(hidden_states, causal_mask, position_ids, past_key_values, cache_position)
        return self.norm(hidden_states), past_key_values


class KQwen3ForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = KQwen3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        hidden, cache = self.model(input_ids, past_key_values=past_key_values, use_cache=use_cache)
        return SimpleNamespace(logits=self.lm_head(hidden), past_key_values=cache if use_cache else None)


def make_model():
    torch.manual_seed(2503)
    config = SimpleNamespace(
        vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1000000.0,
    )
    model = KQwen3ForCausalLM(config)
    g = torch.Generator().manual_seed(25031)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, Qwen3RMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

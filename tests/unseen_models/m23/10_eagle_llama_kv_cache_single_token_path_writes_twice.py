"""EAGLE's target model in the manner of SafeAILab/EAGLE (eagle/model/ea_model.py, modeling_llama_kv.py, kv_cache.py).

`EaModel` holds `base_model` (KVLlamaForCausalLM: the pre-4.36 transformers LLaMA layout,
`base_model.model.layers.N.self_attn` with q/k/v/o_proj, cos/sin tables indexed by `position_ids`,
`_make_causal_mask` with the past columns visible, GQA 4/2 `repeat_kv`, rotate_half base 1e4) and the
preallocated cache EAGLE shares with Medusa: `past_key_values_data` (2 * layers, b, kv, max_len, d), a
`current_length_data` counter and per-layer [KVCache, KVCache] pairs whose `cat` copies the new states
into the next free slots and returns the narrowed view.  The EAGLE draft head is not built.  On
one-token calls the model skips the mask ("a single query sees every cached key").  3 layers.
Cache: hf (`out = model(ids, use_cache=True)`, then `model(tok, past_key_values=out.past_key_values,
use_cache=True)`; logits in `out.logits`).
Slip: `KVCache.cat` has a one-token fast path (`data[..., L, :] = t`, `current_length += 1`) that
falls through into the general narrow/copy_ path instead of returning, so each decoded key and value
is written twice (slots L and L + 1) and the length advances by 2: at step 0 the new token already
attends to two copies of itself.  The prompt pass (several tokens) takes only the general path and
the full forward uses no cache; both are exact.
"""


import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": [
        "base_model.model.layers.0.self_attn",
        "base_model.model.layers.1.self_attn",
        "base_model.model.layers.2.self_attn",
    ],
    "kind": "causal-multihead",
    "cache": "hf",
    "decode": {
        "mistake": "cache_stale",
        "step": 0,
        "layer": "base_model.model.layers.0.self_attn",
    },
    "style": "EAGLE ea_model.py base_model (KVLlamaForCausalLM) with the Medusa-style preallocated KVCache pairs; "
    "slip: the one-token fast path of KVCache.cat falls through into the general copy, so each decoded k/v "
    "is stored twice and current_length advances by 2",
}


class KVCache:
    """A preallocated slab plus a length counter (a 0-d tensor shared with current_length_data)."""

    def __init__(self, data, current_length):
        self.data = data
        self.current_length = current_length

    @property
    def shape(self):
        return (self.data.shape[0], self.data.shape[1], int(self.current_length.item()), self.data.shape[3])

    def cat(self, tensor, dim=2):
        if tensor.shape[dim] == 1:
            # fast path for single-token decoding
            self.data.select(dim, int(self.current_length.item())).copy_(tensor.select(dim, 0))
            self.current_length.add_(1)
        start = int(self.current_length.item())
        dst = self.data.narrow(dim, start, tensor.shape[dim])
        dst.copy_(tensor)
        self.current_length.add_(tensor.shape[dim])
        return torch.narrow(self.data, dim, 0, int(self.current_length.item()))


def initialize_past_key_values(model, batch_size, max_length=64):
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    dtype = model.model.embed_tokens.weight.dtype
    device = model.model.embed_tokens.weight.device
    past_key_values_data = torch.zeros(
        config.num_hidden_layers * 2, batch_size, config.num_key_value_heads, max_length, head_dim,
        dtype=dtype, device=device,
    )
    current_length_data = torch.zeros(config.num_hidden_layers * 2, dtype=torch.long)
    past_key_values = []
    for i in range(config.num_hidden_layers):
        past_key_values.append(
            [KVCache(past_key_values_data[i * 2 + j], current_length_data[i * 2 + j]) for j in range(2)]
        )
    return past_key_values, past_key_values_data, current_length_data


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class LlamaRotaryEmbedding(nn.Module):
    def __init__(self, dim, max_position_embeddings=64, base=10000.0):
        super().__init__()
        self.dim = dim
        self.max_position_embeddings = max_position_embeddings
        self.base = base

    def forward(self, x, seq_len):
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2, dtype=torch.float64) / self.dim))
        t = torch.arange(max(seq_len, self.max_position_embeddings), dtype=torch.float64)
        freqs = torch.einsum("i,j->ij", t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos()[:seq_len].to(x.dtype), emb.sin()[:seq_len].to(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids):
    cos = cos[position_ids].unsqueeze(1)
    sin = sin[position_ids].unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class LlamaAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(self.head_dim, config.max_position_embeddings, config.rope_theta)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None):
        bsz, q_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)

        kv_seq_len = key_states.shape[-2]
        if past_key_value is not None:
            kv_seq_len += past_key_value[0].shape[-2]
        cos, sin = self.rotary_emb(value_states, seq_len=kv_seq_len)
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin, position_ids)

        # [MODIFIED] Using KVCache mechanism for preallocated GPU memory optimization
        if past_key_value is not None:
            key_states = past_key_value[0].cat(key_states, dim=2)
            value_states = past_key_value[1].cat(value_states, dim=2)

        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)

        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(self.head_dim)
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, self.hidden_size)
        return self.o_proj(attn_output)


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = LlamaAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None):
        residual = hidden_states
        hidden_states = self.self_attn(
            self.input_layernorm(hidden_states), attention_mask, position_ids, past_key_value
        )
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


def _make_causal_mask(input_ids_shape, dtype, device, past_key_values_length=0):
    bsz, tgt_len = input_ids_shape
    mask = torch.full((tgt_len, tgt_len), torch.finfo(dtype).min, dtype=dtype, device=device)
    mask_cond = torch.arange(mask.size(-1), device=device)
    mask.masked_fill_(mask_cond < (mask_cond + 1).view(mask.size(-1), 1), 0)
    mask = mask.to(dtype)
    if past_key_values_length > 0:
        mask = torch.cat([torch.zeros(tgt_len, past_key_values_length, dtype=dtype, device=device), mask], dim=-1)
    return mask[None, None, :, :].expand(bsz, 1, tgt_len, tgt_len + past_key_values_length)


class LlamaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids, past_key_values=None):
        batch_size, seq_length = input_ids.shape
        past_key_values_length = past_key_values[0][0].shape[2] if past_key_values is not None else 0
        position_ids = torch.arange(
            past_key_values_length, seq_length + past_key_values_length, dtype=torch.long, device=input_ids.device
        ).unsqueeze(0).expand(batch_size, -1)
        hidden_states = self.embed_tokens(input_ids)
        if seq_length > 1:
            attention_mask = _make_causal_mask(
                (batch_size, seq_length), hidden_states.dtype, input_ids.device, past_key_values_length
            )
        else:
            attention_mask = None
        for idx, decoder_layer in enumerate(self.layers):
            past_key_value = past_key_values[idx] if past_key_values is not None else None
            hidden_states = decoder_layer(hidden_states, attention_mask, position_ids, past_key_value)
        return self.norm(hidden_states)


class KVLlamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        if use_cache and past_key_values is None:
            past_key_values, self.past_key_values_data, self.current_length_data = initialize_past_key_values(
                self, input_ids.shape[0]
            )
        hidden_states = self.model(input_ids, past_key_values=past_key_values)
        return SimpleNamespace(
            logits=self.lm_head(hidden_states), past_key_values=past_key_values if use_cache else None
        )


class EaModel(nn.Module):
    def __init__(self, base_model):
        super().__init__()
        self.base_model = base_model

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        return self.base_model(input_ids, past_key_values=past_key_values, use_cache=use_cache)


def make_model():
    torch.manual_seed(2310)
    config = SimpleNamespace(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
    )
    model = EaModel(KVLlamaForCausalLM(config))
    g = torch.Generator().manual_seed(23101)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LlamaRMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

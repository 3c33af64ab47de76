"""Llama causal LM with streaming-llm's position-shift attention (mit-han-lab/streaming-llm), 3 layers.

As 02: `llama_pos_shift_attention_forward` rotates queries at position_ids, stores keys unrotated in
the (k, v) tuple cache and re-rotates them at key_position_ids = arange(kv_seq_len) on every call;
StartRecentKVCache(4, 92) (never evicts here); GQA 4/2 repeat_kv; rotate_half, base 1e4.
Per-layer patching: `enable_llama_pos_shift_attention` swaps each attention's forward; layer 1 got
the variant written for the Mistral port's experiments, which passes the value states through the same
`apply_rotary_pos_emb_single(..., key_position_ids)` as the keys, so layer 1's values are rotated.
Values are rotated by their own positions, so each token's output still depends only on earlier
tokens and cached decoding agrees with the full pass.
Cache (hf): `out = model(prompt, use_cache=True)`,
`model(tok, past_key_values=out.past_key_values, use_cache=True)`; logits in `out.logits`.
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
        "model.layers.0.self_attn",
        "model.layers.1.self_attn",
        "model.layers.2.self_attn",
    ],
    "kind": "causal-multihead",
    "cache": "hf",
    "layer": "model.layers.1.self_attn",
    "stage": "values",
    "mistake": "rope_on_values",
    "style": "streaming-llm pos_shift llama (keys cached unrotated, re-rotated at arange(kv_seq_len)), GQA 4/2; "
    "layer 1's patched forward also rotates the value states with the key positions",
}


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class LlamaRotaryEmbedding(nn.Module):
    def __init__(self, dim, max_position_embeddings=128, base=10000.0):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        t = torch.arange(max_position_embeddings, dtype=torch.float64)
        emb = torch.cat([torch.outer(t, inv_freq)] * 2, dim=-1)
        # plain float64 attributes (not buffers), cast at use
        self.cos_cached = emb.cos()[None, None]
        self.sin_cached = emb.sin()[None, None]

    def forward(self, x, seq_len):
        return (
            self.cos_cached[:, :, :seq_len].to(dtype=x.dtype, device=x.device),
            self.sin_cached[:, :, :seq_len].to(dtype=x.dtype, device=x.device),
        )


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb_single(x, cos, sin, position_ids):
    cos = cos.squeeze(1).squeeze(0)[position_ids].unsqueeze(1)  # [bs, 1, seq_len, dim]
    sin = sin.squeeze(1).squeeze(0)[position_ids].unsqueeze(1)
    return (x * cos) + (rotate_half(x) * sin)


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class LlamaAttention(nn.Module):
    def __init__(self, config, shift_values=False):
        super().__init__()
        self.shift_values = shift_values
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(self.head_dim, config.max_position_embeddings)

    # streaming_llm.pos_shift: llama_pos_shift_attention_forward
    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None, use_cache=False):
        bsz, q_len, _ = hidden_states.size()
        if position_ids is None:
            position_ids = torch.arange(q_len, device=hidden_states.device)[None].expand(bsz, -1)
        query_states = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)

        kv_seq_len = key_states.shape[-2]
        if past_key_value is not None:
            kv_seq_len += past_key_value[0].shape[-2]
        cos, sin = self.rotary_emb(value_states, seq_len=kv_seq_len)
        query_states = apply_rotary_pos_emb_single(query_states, cos, sin, position_ids)

        if past_key_value is not None:
            key_states = torch.cat([past_key_value[0], key_states], dim=2)
            value_states = torch.cat([past_key_value[1], value_states], dim=2)
        past_key_value = (key_states, value_states) if use_cache else None

        key_position_ids = torch.arange(kv_seq_len, device=position_ids.device).unsqueeze(0)
        key_states = apply_rotary_pos_emb_single(key_states, cos, sin, key_position_ids)
        if self.shift_values:
            value_states = apply_rotary_pos_emb_single(value_states, cos, sin, key_position_ids)

        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)

        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(self.head_dim)
        if attention_mask is None:
            attention_mask = _make_causal_mask(bsz, q_len, kv_seq_len - q_len, attn_weights.dtype, attn_weights.device)
        attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).contiguous().reshape(bsz, q_len, self.hidden_size)
        return self.o_proj(attn_output), None, past_key_value


def _make_causal_mask(bsz, tgt_len, past_key_values_length, dtype, device):
    mask = torch.full((tgt_len, tgt_len), torch.finfo(dtype).min, dtype=dtype, device=device)
    mask_cond = torch.arange(mask.size(-1), device=device)
    mask.masked_fill_(mask_cond < (mask_cond + 1).view(mask.size(-1), 1), 0)
    mask = mask.to(dtype)
    if past_key_values_length > 0:
        mask = torch.cat([torch.zeros(tgt_len, past_key_values_length, dtype=dtype, device=device), mask], dim=-1)
    return mask[None, None, :, :].expand(bsz, 1, tgt_len, tgt_len + past_key_values_length)


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx=0):
        super().__init__()
        self.self_attn = LlamaAttention(config, shift_values=layer_idx in config.value_shift_layers)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask, position_ids, past_key_value, use_cache):
        residual = hidden_states
        hidden_states, _, present = self.self_attn(
            self.input_layernorm(hidden_states), attention_mask=attention_mask,
            position_ids=position_ids, past_key_value=past_key_value, use_cache=use_cache,
        )
        hidden_states = residual + hidden_states
        hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states, present


class LlamaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        bsz, seq_length = input_ids.shape
        past_key_values_length = past_key_values[0][0].shape[2] if past_key_values is not None else 0
        position_ids = torch.arange(
            past_key_values_length, seq_length + past_key_values_length, device=input_ids.device
        ).unsqueeze(0).expand(bsz, -1)
        hidden_states = self.embed_tokens(input_ids)
        attention_mask = _make_causal_mask(bsz, seq_length, past_key_values_length, hidden_states.dtype, input_ids.device)
        next_decoder_cache = ()
        for idx, decoder_layer in enumerate(self.layers):
            past_key_value = past_key_values[idx] if past_key_values is not None else None
            hidden_states, present = decoder_layer(hidden_states, attention_mask, position_ids, past_key_value, use_cache)
            next_decoder_cache += (present,)
        return self.norm(hidden_states), (next_decoder_cache if use_cache else None)


class StartRecentKVCache:
    def __init__(self, start_size=4, recent_size=512, k_seq_dim=2, v_seq_dim=2):
        self.start_size = start_size
        self.recent_size = recent_size
        self.cache_size = start_size + recent_size
        self.k_seq_dim = k_seq_dim
        self.v_seq_dim = v_seq_dim

    def __call__(self, past_key_values):
        if past_key_values is None:
            return None
        seq_len = past_key_values[0][0].size(self.k_seq_dim)
        if seq_len <= self.cache_size:
            return past_key_values
        return tuple(
            (
                torch.cat([k[:, :, : self.start_size], k[:, :, seq_len - self.recent_size :]], dim=self.k_seq_dim),
                torch.cat([v[:, :, : self.start_size], v[:, :, seq_len - self.recent_size :]], dim=self.v_seq_dim),
            )
            for k, v in past_key_values
        )


class LlamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.kv_cache = StartRecentKVCache(start_size=config.start_size, recent_size=config.recent_size)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        past_key_values = self.kv_cache(past_key_values)
        hidden, cache = self.model(input_ids, past_key_values=past_key_values, use_cache=use_cache)
        return SimpleNamespace(logits=self.lm_head(hidden), past_key_values=cache)


def make_model():
    torch.manual_seed(2506)
    config = SimpleNamespace(
        vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rms_norm_eps=1e-6, start_size=4, recent_size=92, value_shift_layers=(1,),
    )
    model = LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(25061)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LlamaRMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

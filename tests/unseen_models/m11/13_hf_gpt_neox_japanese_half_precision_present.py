"""GPT-NeoX-Japanese (abeja), after transformers' modeling_gpt_neox_japanese.py.

GPTNeoXJapaneseForCausalLM: gpt_neox_japanese (embed_in, layers.N, final_layer_norm) and embed_out.
GPTNeoXJapaneseLayer: input_layernorm -> attention, whose `dense` has no bias and returns its separate
`dense_bias` (added with the residual, the bias_dropout_add of the original), post_attention_layernorm ->
mlp (dense_h_to_4h / dense_4h_to_h, no bias, gelu), sequential residual.  GPTNeoXJapaneseAttention: fused
`query_key_value` (no bias) viewed (b, s, heads, 3 * head_size) and chunked, partial rotary on the first
rotary_ndims = 8 of 16 dims (rotary_pct 0.5, rotate_half, base 1e4) at position offset = past length,
matmul with the 1/sqrt(d) `norm_factor` applied through baddbmm alpha, tril `bias` buffer with
`masked_bias` -1e9, softmax, merge, dense.
Cache: hf tuples: layer_past = (k, v) in (b, heads, s, d), concatenated on dim -2;
`out = model(ids, use_cache=True)`, `model(tok, past_key_values=out.past_key_values, use_cache=True)`.
Slip: with `config.kv_cache_dtype = "float16"` (a memory option) each layer stores its `present` as
float16 and casts it back to the activation dtype when it is read, so every cached key and value is
rounded: decoding drifts from step 0 at layer 0 (even in float64), while the full forward and prompt
pass are exact.
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
        "gpt_neox_japanese.layers.0.attention",
        "gpt_neox_japanese.layers.1.attention",
        "gpt_neox_japanese.layers.2.attention",
    ],
    "kind": "causal-multihead",
    "cache": "hf",
    "decode": {"mistake": "cache_other", "step": 0, "layer": "gpt_neox_japanese.layers.0.attention"},
    "style": "modeling_gpt_neox_japanese.py: fused query_key_value, partial rotary 0.5, dense without bias plus a separate "
    "dense_bias, baddbmm alpha norm_factor; presents stored in float16 and read back rounded",
}


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, max_position_embeddings=128, base=10000.0):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        t = torch.arange(max_position_embeddings, dtype=torch.float64)
        emb = torch.cat((torch.einsum("i,j->ij", t, inv_freq),) * 2, dim=-1)
        self.register_buffer("cos_cached", emb.cos()[None, None], persistent=False)
        self.register_buffer("sin_cached", emb.sin()[None, None], persistent=False)

    def forward(self, x, seq_len):
        return self.cos_cached[:, :, :seq_len].to(x.dtype), self.sin_cached[:, :, :seq_len].to(x.dtype)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, offset=0):
    cos = cos[..., offset:q.shape[-2] + offset, :]
    sin = sin[..., offset:q.shape[-2] + offset, :]
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class GPTNeoXJapaneseAttention(nn.Module):
    def __init__(self, config, use_bias=False):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.hidden_size = config.hidden_size
        self.head_size = self.hidden_size // self.num_attention_heads
        self.rotary_ndims = int(self.head_size * config.rotary_pct)
        self.rotary_emb = RotaryEmbedding(self.rotary_ndims, base=config.rotary_emb_base)
        self.register_buffer("bias", torch.tril(torch.ones(128, 128, dtype=torch.bool)).view(1, 1, 128, 128),
                             persistent=False)
        self.register_buffer("masked_bias", torch.tensor(-1e9), persistent=False)
        self.norm_factor = math.sqrt(self.head_size)
        self.query_key_value = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=False)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.use_bias = use_bias
        self.dense_bias = nn.Parameter(torch.zeros(config.hidden_size)) if use_bias else None
        self.kv_cache_dtype = getattr(torch, config.kv_cache_dtype) if config.kv_cache_dtype else None

    def forward(self, hidden_states, layer_past=None, use_cache=False):
        has_layer_past = layer_past is not None and layer_past[0].numel() > 0
        qkv = self.query_key_value(hidden_states)
        new_qkv_shape = qkv.size()[:-1] + (self.num_attention_heads, 3 * self.head_size)
        qkv = qkv.view(*new_qkv_shape)
        query = qkv[..., : self.head_size].permute(0, 2, 1, 3)
        key = qkv[..., self.head_size : 2 * self.head_size].permute(0, 2, 1, 3)
        value = qkv[..., 2 * self.head_size :].permute(0, 2, 1, 3)

        query_rot, query_pass = query[..., : self.rotary_ndims], query[..., self.rotary_ndims :]
        key_rot, key_pass = key[..., : self.rotary_ndims], key[..., self.rotary_ndims :]
        seq_len = key.shape[-2]
        offset = 0
        if has_layer_past:
            offset = layer_past[0].shape[-2]
            seq_len += offset
        cos, sin = self.rotary_emb(value, seq_len=seq_len)
        query, key = apply_rotary_pos_emb(query_rot, key_rot, cos, sin, offset=offset)
        query = torch.cat((query, query_pass), dim=-1)
        key = torch.cat((key, key_pass), dim=-1)

        if has_layer_past:
            key = torch.cat((layer_past[0].to(key.dtype), key), dim=-2)
            value = torch.cat((layer_past[1].to(value.dtype), value), dim=-2)
        present = None
        if use_cache:
            present = (key, value) if self.kv_cache_dtype is None else (key.to(self.kv_cache_dtype), value.to(self.kv_cache_dtype))

        attn_output = self._attn(query, key, value)
        b, h, s, d = attn_output.shape
        attn_output = attn_output.permute(0, 2, 1, 3).contiguous().view(b, s, h * d)
        attn_output = self.dense(attn_output)
        return attn_output, present, self.dense_bias

    def _attn(self, query, key, value):
        batch_size, num_heads, query_length, attn_head_size = query.size()
        key_length = key.size(-2)
        causal_mask = self.bias[:, :, key_length - query_length : key_length, :key_length]
        query = query.reshape(batch_size * num_heads, query_length, attn_head_size)
        key = key.reshape(batch_size * num_heads, key_length, attn_head_size)
        attn_scores = torch.zeros(batch_size * num_heads, query_length, key_length, dtype=query.dtype, device=key.device)
        attn_scores = torch.baddbmm(attn_scores, query, key.transpose(1, 2), beta=1.0, alpha=1.0 / self.norm_factor)
        attn_scores = attn_scores.view(batch_size, num_heads, query_length, key_length)
        attn_scores = torch.where(causal_mask, attn_scores, self.masked_bias.to(attn_scores.dtype))
        attn_weights = F.softmax(attn_scores, dim=-1)
        return torch.matmul(attn_weights, value)


class GPTNeoXJapaneseMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        intermediate_size = int(config.hidden_size * config.intermediate_multiple_size)
        self.dense_h_to_4h = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.dense_4h_to_h = nn.Linear(intermediate_size, config.hidden_size, bias=False)

    def forward(self, hidden_states):
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(hidden_states)))


class GPTNeoXJapaneseLayer(nn.Module):
    def __init__(self, config, layer_number):
        super().__init__()
        self.layer_number = layer_number
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attention = GPTNeoXJapaneseAttention(config, use_bias=layer_number == config.num_hidden_layers - 1)
        self.mlp = GPTNeoXJapaneseMLP(config)

    def forward(self, hidden_states, layer_past=None, use_cache=False):
        residual = hidden_states
        attn_output, present, attn_bias = self.attention(self.input_layernorm(hidden_states), layer_past, use_cache)
        if attn_bias is not None:
            attn_output = attn_output + attn_bias
        attn_output = attn_output + residual
        mlp_output = self.mlp(self.post_attention_layernorm(attn_output))
        return mlp_output + attn_output, present


class GPTNeoXJapaneseModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_in = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([GPTNeoXJapaneseLayer(config, i) for i in range(config.num_hidden_layers)])
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        if past_key_values is None:
            past_key_values = tuple([None] * len(self.layers))
        hidden_states = self.embed_in(input_ids)
        presents = () if use_cache else None
        for layer, layer_past in zip(self.layers, past_key_values):
            hidden_states, present = layer(hidden_states, layer_past, use_cache)
            if use_cache:
                presents = presents + (present,)
        return self.final_layer_norm(hidden_states), presents


class GPTNeoXJapaneseForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.gpt_neox_japanese = GPTNeoXJapaneseModel(config)
        self.embed_out = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        hidden, presents = self.gpt_neox_japanese(input_ids, past_key_values, use_cache)
        return SimpleNamespace(logits=self.embed_out(hidden), past_key_values=presents)


def make_model():
    torch.manual_seed(1113)
    config = SimpleNamespace(vocab_size=96, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                             intermediate_multiple_size=2, rotary_pct=0.5, rotary_emb_base=10000.0,
                             layer_norm_eps=1e-5, kv_cache_dtype="float16")
    model = GPTNeoXJapaneseForCausalLM(config)
    g = torch.Generator().manual_seed(11131)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
        model.gpt_neox_japanese.layers[-1].attention.dense_bias.normal_(0.0, 0.1, generator=g)
    return model.eval()

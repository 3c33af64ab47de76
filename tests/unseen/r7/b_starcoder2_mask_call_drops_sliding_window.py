"""Starcoder2-style model body (GQA 6:2, biased projections, rotary theta ~1e6, config.sliding_window=5); bug: the
model's mask helper takes a sliding_window argument but the call leaves it out, so the layer gets a plain causal mask."""

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def repeat_kv(hidden_states, n_rep):
    """(b, kv_heads, s, d) -> (b, kv_heads * n_rep, s, d), each kv head repeated n_rep times in place."""
    b, kvh, s, d = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    expanded = hidden_states[:, :, None].expand(b, kvh, n_rep, s, d)
    return expanded.reshape(b, kvh * n_rep, s, d)


class Starcoder2RotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        dim = config.hidden_size // config.num_attention_heads
        steps = torch.arange(0, dim, 2, dtype=torch.float64)
        self.register_buffer(
            "inv_freq", 1.0 / (config.rope_theta ** (steps / dim)), persistent=False
        )

    def forward(self, x, position_ids):
        freqs = torch.einsum("bs,f->bsf", position_ids.to(self.inv_freq.dtype), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class Starcoder2Attention(nn.Module):
    def __init__(self, config, layer_idx=None):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.q_proj = nn.Linear(
            config.hidden_size, config.num_attention_heads * self.head_dim, bias=config.use_bias
        )
        self.k_proj = nn.Linear(
            config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.use_bias
        )
        self.v_proj = nn.Linear(
            config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.use_bias
        )
        self.o_proj = nn.Linear(
            config.num_attention_heads * self.head_dim, config.hidden_size, bias=config.use_bias
        )
        self.residual_dropout = config.residual_dropout

    def forward(self, hidden_states, position_embeddings, attention_mask):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.scaling
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask[:, :, :, : key_states.shape[-2]]
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_weights = F.dropout(attn_weights, p=self.attention_dropout, training=self.training)
        attn_output = torch.matmul(attn_weights, value_states).transpose(1, 2).contiguous()

        attn_output = attn_output.reshape(*input_shape, -1)
        attn_output = self.o_proj(attn_output)
        attn_output = F.dropout(attn_output, p=self.residual_dropout, training=self.training)
        return attn_output, attn_weights


class Starcoder2MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.use_bias)
        self.c_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.use_bias)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Starcoder2DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = Starcoder2Attention(config, layer_idx)
        self.mlp = Starcoder2MLP(config)
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.norm_epsilon)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.norm_epsilon)

    def forward(self, hidden_states, attention_mask, position_embeddings):
        residual = hidden_states
        hidden_states, _ = self.self_attn(
            self.input_layernorm(hidden_states),
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
        )
        hidden_states = residual + hidden_states
        residual = hidden_states
        return residual + self.mlp(self.post_attention_layernorm(hidden_states))


def _prepare_4d_causal_attention_mask(
    attention_mask, input_shape, inputs_embeds, past_key_values_length, sliding_window=None
):
    """Additive (b, 1, q, k) mask from a (b, k) padding mask; with sliding_window, a query sees itself and the
    sliding_window - 1 keys before it."""
    bsz, q_len = input_shape
    kv_len = q_len + past_key_values_length
    dtype, device = inputs_embeds.dtype, inputs_embeds.device
    q_idx = torch.arange(past_key_values_length, kv_len, device=device).view(-1, 1)
    kv_idx = torch.arange(kv_len, device=device).view(1, -1)
    visible = kv_idx <= q_idx
    if sliding_window is not None:
        visible = visible & (kv_idx > q_idx - sliding_window)
    visible = visible[None] & attention_mask[:, None, :].bool()
    mask = torch.full((bsz, q_len, kv_len), torch.finfo(dtype).min, dtype=dtype, device=device)
    return mask.masked_fill(visible, 0.0)[:, None]


class Starcoder2Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(
            [Starcoder2DecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.norm_epsilon)
        self.rotary_emb = Starcoder2RotaryEmbedding(config)
        self.embedding_dropout = config.embedding_dropout

    def forward(self, inputs_embeds):
        bsz, seq_len, _ = inputs_embeds.shape
        position_ids = torch.arange(seq_len, device=inputs_embeds.device)[None].expand(bsz, -1)
        attention_mask = torch.ones(bsz, seq_len, dtype=torch.long, device=inputs_embeds.device)
        causal_mask = _prepare_4d_causal_attention_mask(
            attention_mask, (bsz, seq_len), inputs_embeds, 0
        )
        hidden_states = F.dropout(inputs_embeds, p=self.embedding_dropout, training=self.training)
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(hidden_states, causal_mask, position_embeddings)
        return self.norm(hidden_states)


def make_starcoder2():
    config = SimpleNamespace(
        hidden_size=96,
        num_attention_heads=6,
        num_key_value_heads=2,
        intermediate_size=192,
        num_hidden_layers=1,
        rope_theta=999999.4420358813,
        sliding_window=5,
        use_bias=True,
        norm_epsilon=1e-5,
        attention_dropout=0.0,
        residual_dropout=0.0,
        embedding_dropout=0.0,
    )
    return Starcoder2Model(config)


EXPECT = {
    "target": "make_starcoder2",
    "kind": "causal-multihead",
    "ok": False,
    "stage": "masked_scores",
    "mistake": "window_missing",
    "layer": "layers.0.self_attn",
    "style": "HF Starcoder2Model/Starcoder2Attention (use_bias, repeat_kv, rope_theta 999999.44, config.sliding_window=5); _prepare_4d_causal_attention_mask called without sliding_window=",
}

"""Falcon-40B/180B (new_decoder_architecture) FalconAttention in HF's FalconModel: fused
query_key_value laid out per kv group (heads//kv_heads queries, one key, one value), keys/values
repeat_interleave'd to the query heads, rotate_half RoPE from a model-level rotary module, SDPA with
the model's additive mask or is_causal, dense. Parallel block with ln_attn and ln_mlp.

This file: correct. Positions are attention_mask.cumsum(-1) without the - 1 (1..n): a uniform shift."""

import math

import torch
import torch.nn.functional as F
from torch import nn


class FalconConfig:
    hidden_size = 64
    num_attention_heads = 8
    num_kv_heads = 2
    new_decoder_architecture = True
    parallel_attn = True
    bias = False
    rope_theta = 10000.0
    layer_norm_epsilon = 1e-5
    num_hidden_layers = 1
    max_position_embeddings = 128


class FalconRotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        dim = config.hidden_size // config.num_attention_heads
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x, position_ids):
        inv_freq_expanded = (
            self.inv_freq[None, :, None].double().expand(position_ids.shape[0], -1, 1)
        )
        position_ids_expanded = position_ids[:, None, :].double()
        freqs = (inv_freq_expanded @ position_ids_expanded).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


class FalconAttention(nn.Module):
    def __init__(self, config, layer_idx=None):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.layer_idx = layer_idx
        self.is_causal = True
        self.inv_norm_factor = 1.0 / math.sqrt(self.head_dim)
        # new_decoder_architecture: per kv group, (heads // kv_heads) queries, then one key, one value
        qkv_out_dim = (self.num_kv_heads * 2 + self.num_heads) * self.head_dim
        self.query_key_value = nn.Linear(self.hidden_size, qkv_out_dim, bias=config.bias)
        self.dense = nn.Linear(self.hidden_size, self.hidden_size, bias=config.bias)

    def _split_heads(self, fused_qkv):
        batch, seq_len, _ = fused_qkv.shape
        per_group = self.num_heads // self.num_kv_heads
        qkv = fused_qkv.view(batch, seq_len, self.num_kv_heads, per_group + 2, self.head_dim)
        query = qkv[:, :, :, :-2].flatten(2, 3)  # (b, s, heads, hd), group-major
        key = qkv[:, :, :, -2]  # (b, s, kv_heads, hd)
        value = qkv[:, :, :, -1]
        key = key.repeat_interleave(per_group, dim=2)
        value = value.repeat_interleave(per_group, dim=2)
        return query, key, value

    def forward(self, hidden_states, position_embeddings, attention_mask=None):
        fused_qkv = self.query_key_value(hidden_states)
        batch_size, query_length, _ = hidden_states.shape
        query_layer, key_layer, value_layer = self._split_heads(fused_qkv)
        query_layer = query_layer.transpose(1, 2)
        key_layer = key_layer.transpose(1, 2)
        value_layer = value_layer.transpose(1, 2)

        cos, sin = position_embeddings
        query_layer, key_layer = apply_rotary_pos_emb(query_layer, key_layer, cos, sin)

        attn_output = F.scaled_dot_product_attention(
            query_layer,
            key_layer,
            value_layer,
            attn_mask=attention_mask,
            dropout_p=0.0,
            is_causal=self.is_causal and attention_mask is None and query_length > 1,
        )
        attn_output = attn_output.transpose(1, 2)
        attn_output = attn_output.reshape(batch_size, query_length, self.num_heads * self.head_dim)
        return self.dense(attn_output)


class FalconMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(config.hidden_size, 4 * config.hidden_size, bias=config.bias)
        self.act = nn.GELU()
        self.dense_4h_to_h = nn.Linear(4 * config.hidden_size, config.hidden_size, bias=config.bias)

    def forward(self, x):
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))


class FalconDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attention = FalconAttention(config, layer_idx)
        self.mlp = FalconMLP(config)
        # new_decoder_architecture: two LayerNorms, attention and MLP in parallel
        self.ln_attn = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.ln_mlp = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)

    def forward(self, hidden_states, position_embeddings, attention_mask=None):
        residual = hidden_states
        attention_layernorm_out = self.ln_attn(hidden_states)
        mlp_layernorm_out = self.ln_mlp(hidden_states)
        attention_output = self.self_attention(
            attention_layernorm_out, position_embeddings, attention_mask=attention_mask
        )
        mlp_output = self.mlp(mlp_layernorm_out)
        return mlp_output + attention_output + residual


class FalconModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.h = nn.ModuleList(
            [FalconDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.rotary_emb = FalconRotaryEmbedding(config)

    def _update_causal_mask(self, attention_mask, input_tensor):
        # always an explicit additive mask: finfo.min above the diagonal, plus padding
        dtype = input_tensor.dtype
        seq_len = input_tensor.shape[1]
        min_dtype = torch.finfo(dtype).min
        causal = torch.full((seq_len, seq_len), min_dtype, dtype=dtype, device=input_tensor.device)
        causal = torch.triu(causal, diagonal=1)[None, None, :, :]
        padding = (1.0 - attention_mask[:, None, None, :].to(dtype)) * min_dtype
        return (causal + padding).clamp(min=min_dtype)

    def forward(self, inputs_embeds, attention_mask=None):
        batch_size, seq_length, _ = inputs_embeds.shape
        if attention_mask is None:
            attention_mask = torch.ones(
                batch_size, seq_length, dtype=torch.long, device=inputs_embeds.device
            )
        # positions from the padding mask; the "- 1" is left out, so they run 1..n (a uniform shift)
        position_ids = attention_mask.long().cumsum(-1)
        causal_mask = self._update_causal_mask(attention_mask, inputs_embeds)
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        hidden_states = inputs_embeds
        for block in self.h:
            hidden_states = block(hidden_states, position_embeddings, attention_mask=causal_mask)
        return self.ln_f(hidden_states)


def make_falcon():
    torch.manual_seed(1411)
    model = FalconModel(FalconConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.6, 1.4)
                mod.bias.normal_(0.0, 0.1)
    return model.eval()


EXPECT = {
    "target": "make_falcon",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "h.0.self_attention",
    "structure": {
        "heads": 8,
        "kv_heads": 2,
        "head_dim": 8,
        "causal": True,
        "cross": False,
        "rope": {"pairing": "half", "fraction": 1.0, "base": 10000},
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "Falcon-40B new_decoder_architecture: grouped fused qkv (4 queries + k + v per group), "
    "repeat_interleave GQA 8:2, rotate_half RoPE at cumsum positions 1..n (uniform shift), SDPA"
    " with the model's additive finfo.min mask, parallel ln_attn/ln_mlp block",
}

"""A tiny Falcon (new_decoder_architecture, Falcon-40B layout) in the style of Hugging Face's
modeling_falcon.py (no cache).

FalconForCausalLM -> transformer (word_embeddings, h ModuleList of FalconDecoderLayer, ln_f,
rotary_emb) + tied lm_head.  Fused query_key_value grouped per kv head:
view(b, s, num_kv_heads, heads_per_kv + 2, head_dim), the last two slots of each group are
that group's key and value (GQA 8/2: query head h uses kv head h // 4).  Rotary with
rotate_half.  Parallel attention: ln_attn and ln_mlp both read the block input; the block
output is attn + mlp + residual.  No biases.

The attention class is chosen per layer from FALCON_ATTENTION_CLASSES (config
layer_attn_implementation = eager, eager, sdpa).

Slip: FalconSdpaAttention merges heads with attn_output.reshape(b, s, heads * head_dim)
straight from the (b, heads, s, head_dim) SDPA output, with no transpose, so features of
different tokens are mixed.  The first layer using it is transformer.h.2.self_attention.
"""

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": [
        "transformer.h.0.self_attention",
        "transformer.h.1.self_attention",
        "transformer.h.2.self_attention",
    ],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "transformer.h.2.self_attention",
    "stage": "output",
    "mistake": "heads_merge",
    "style": "transformers modeling_falcon.py new_decoder_architecture: grouped fused qkv, _merge_heads, parallel "
    "ln_attn/ln_mlp; slip: the per-layer SDPA class reshapes (b, h, s, d) to (b, s, h*d) without transposing",
}


@dataclass
class FalconConfig:
    vocab_size: int = 128
    hidden_size: int = 64
    num_hidden_layers: int = 3
    num_attention_heads: int = 8
    num_kv_heads: int = 2
    layer_norm_epsilon: float = 1e-5
    rope_theta: float = 10000.0
    layer_attn_implementation: list = field(default_factory=lambda: ["eager", "eager", "sdpa"])


class FalconRotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        dim = config.hidden_size // config.num_attention_heads
        inv_freq = 1.0 / (
            config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
        )
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x, position_ids):
        inv_freq_expanded = (
            self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        )
        freqs = (inv_freq_expanded @ position_ids[:, None, :].float()).transpose(1, 2)
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


class FalconAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.layer_idx = layer_idx
        self.inv_norm_factor = 1.0 / math.sqrt(self.head_dim)
        self.beta = self.inv_norm_factor
        qkv_out_dim = (config.num_kv_heads * 2 + config.num_attention_heads) * self.head_dim
        self.query_key_value = nn.Linear(self.hidden_size, qkv_out_dim, bias=False)
        self.dense = nn.Linear(self.hidden_size, self.hidden_size, bias=False)
        self.attention_dropout = nn.Dropout(0.0)

    def _split_heads(self, fused_qkv):
        batch, seq_len, _ = fused_qkv.shape
        qkv = fused_qkv.view(
            batch, seq_len, -1, self.num_heads // self.num_kv_heads + 2, self.head_dim
        )
        query = qkv[:, :, :, :-2]
        key = qkv[:, :, :, [-2]]
        value = qkv[:, :, :, [-1]]
        key = torch.broadcast_to(key, query.shape)
        value = torch.broadcast_to(value, query.shape)
        query, key, value = [x.flatten(2, 3) for x in (query, key, value)]
        return query, key, value

    def _merge_heads(self, x):
        batch_size_and_num_heads, seq_length, _ = x.shape
        batch_size = batch_size_and_num_heads // self.num_heads
        x = x.view(batch_size, self.num_heads, seq_length, self.head_dim)
        x = x.permute(0, 2, 1, 3)
        return x.reshape(batch_size, seq_length, self.num_heads * self.head_dim)

    def _qkv(self, hidden_states, position_embeddings):
        fused_qkv = self.query_key_value(hidden_states)
        (query_layer, key_layer, value_layer) = self._split_heads(fused_qkv)
        batch_size, query_length, _, _ = query_layer.shape
        query_layer = query_layer.transpose(1, 2).reshape(
            batch_size, self.num_heads, query_length, self.head_dim
        )
        key_layer = key_layer.transpose(1, 2).reshape(
            batch_size, self.num_heads, query_length, self.head_dim
        )
        value_layer = value_layer.transpose(1, 2).reshape(
            batch_size, self.num_heads, query_length, self.head_dim
        )
        cos, sin = position_embeddings
        query_layer, key_layer = apply_rotary_pos_emb(query_layer, key_layer, cos, sin)
        return query_layer, key_layer, value_layer

    def forward(self, hidden_states, attention_mask, position_embeddings):
        query_layer, key_layer, value_layer = self._qkv(hidden_states, position_embeddings)
        batch_size, _, query_length, _ = query_layer.shape
        attention_scores = query_layer @ key_layer.transpose(-1, -2)
        attention_scores /= math.sqrt(self.head_dim)
        attention_scores = F.softmax(
            attention_scores + attention_mask, dim=-1, dtype=hidden_states.dtype
        )
        attention_scores = self.attention_dropout(attention_scores)
        attn_output = attention_scores @ value_layer
        attn_output = attn_output.view(batch_size * self.num_heads, query_length, self.head_dim)
        attn_output = self._merge_heads(attn_output)
        return self.dense(attn_output)


class FalconSdpaAttention(FalconAttention):
    def forward(self, hidden_states, attention_mask, position_embeddings):
        query_layer, key_layer, value_layer = self._qkv(hidden_states, position_embeddings)
        batch_size, _, query_length, _ = query_layer.shape
        attn_output = F.scaled_dot_product_attention(
            query_layer, key_layer, value_layer, attn_mask=attention_mask, dropout_p=0.0
        )
        attn_output = attn_output.reshape(batch_size, query_length, self.num_heads * self.head_dim)
        return self.dense(attn_output)


FALCON_ATTENTION_CLASSES = {"eager": FalconAttention, "sdpa": FalconSdpaAttention}


class FalconMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(config.hidden_size, 4 * config.hidden_size, bias=False)
        self.act = nn.GELU()
        self.dense_4h_to_h = nn.Linear(4 * config.hidden_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))


class FalconDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        impl = config.layer_attn_implementation[layer_idx]
        self.self_attention = FALCON_ATTENTION_CLASSES[impl](config, layer_idx)
        self.mlp = FalconMLP(config)
        self.ln_attn = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.ln_mlp = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)

    def forward(self, hidden_states, attention_mask, position_embeddings):
        residual = hidden_states
        attention_layernorm_out = self.ln_attn(hidden_states)
        mlp_layernorm_out = self.ln_mlp(hidden_states)
        attention_output = self.self_attention(
            attention_layernorm_out,
            attention_mask=attention_mask,
            position_embeddings=position_embeddings,
        )
        mlp_output = self.mlp(mlp_layernorm_out)
        return mlp_output + attention_output + residual


class FalconModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.h = nn.ModuleList(
            [FalconDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.rotary_emb = FalconRotaryEmbedding(config=config)

    def forward(self, input_ids):
        hidden_states = self.word_embeddings(input_ids)
        T = input_ids.shape[1]
        position_ids = torch.arange(T).unsqueeze(0)
        blocked = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
        mask = torch.zeros(T, T, dtype=hidden_states.dtype).masked_fill(
            blocked, torch.finfo(hidden_states.dtype).min
        )
        mask = mask[None, None]
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for block in self.h:
            hidden_states = block(
                hidden_states, attention_mask=mask, position_embeddings=position_embeddings
            )
        return self.ln_f(hidden_states)


class FalconForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.transformer = FalconModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.word_embeddings.weight

    def forward(self, input_ids):
        return self.lm_head(self.transformer(input_ids))


def make_model():
    torch.manual_seed(1212)
    model = FalconForCausalLM(FalconConfig())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn_like(m.weight))
                m.bias.copy_(0.1 * torch.randn_like(m.bias))
    return model.eval()

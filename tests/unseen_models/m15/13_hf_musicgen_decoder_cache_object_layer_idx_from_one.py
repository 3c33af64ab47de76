"""MusicGen's decoder used as an unconditioned one-codebook LM, after transformers' modeling_musicgen.py.

MusicgenForCausalLM: decoder (MusicgenModel -> decoder = MusicgenDecoder: embed_tokens (a ModuleList, one
Embedding per codebook; num_codebooks 1, so input ids are (b, t)), embed_positions
(MusicgenSinusoidalPositionalEmbedding: cos block then sin block, computed in float64, offset by the past
length), layers.N, layer_norm), lm_heads (one Linear per codebook).  MusicgenDecoderLayer (pre-norm):
self_attn_layer_norm -> self_attn -> + residual; final_layer_norm -> fc1 -> gelu -> fc2 -> + residual
(the cross-attention block is not built: no conditioning).  MusicgenAttention (BART-style): q_proj(h) *
scaling, k_proj/v_proj, (b, h, s, d), `past_key_value.update(k, v, self.layer_idx)`, additive causal
mask (finfo.min) with the past columns visible, softmax, out_proj; 4 heads of 16, no biases.
Cache: hf.  `MusicgenCache` is a DynamicCache-like object: `update(k, v, layer_idx)` appends a new layer
entry (and returns the states it was given) while `len(self.key_cache) <= layer_idx`, else concatenates on dim -2; `get_seq_length()`.
`out = model(ids, use_cache=True)` creates it; then `model(tok, past_key_values=out.past_key_values,
use_cache=True)`.  Logits in `out.logits` (b, t, 96).
Slip: the decoder numbers its layers from 1 (`MusicgenDecoderLayer(config, layer_idx=i + 1)`, copied from a
checkpoint-conversion loop that skipped the embedding).  During the prompt every layer appends, so the
entries line up by call order and the prompt pass is exact; from the first decoded token on, layer 0
(layer_idx 1) reads and extends layer 1's entry, layer 1 reads layer 2's, and layer 2 (layer_idx 3)
opens a fresh entry.
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
        "decoder.model.decoder.layers.0.self_attn",
        "decoder.model.decoder.layers.1.self_attn",
        "decoder.model.decoder.layers.2.self_attn",
    ],
    "kind": "causal-multihead",
    "cache": "hf",
    "decode": {"mistake": "cache_other", "step": 0, "layer": "decoder.model.decoder.layers.0.self_attn"},
    "style": "modeling_musicgen.py decoder as a one-codebook LM: sinusoidal cos|sin positions offset by the past, BART-style "
    "q*scaling attention, DynamicCache-like MusicgenCache; slip: layer_idx numbered from 1, so decode reads the "
    "next layer's cache entry",
}


class MusicgenCache:
    def __init__(self):
        self.key_cache = []
        self.value_cache = []

    def update(self, key_states, value_states, layer_idx):
        if len(self.key_cache) <= layer_idx:
            self.key_cache.append(key_states)
            self.value_cache.append(value_states)
            return key_states, value_states
        self.key_cache[layer_idx] = torch.cat([self.key_cache[layer_idx], key_states], dim=-2)
        self.value_cache[layer_idx] = torch.cat([self.value_cache[layer_idx], value_states], dim=-2)
        return self.key_cache[layer_idx], self.value_cache[layer_idx]

    def get_seq_length(self, layer_idx=0):
        if len(self.key_cache) <= layer_idx:
            return 0
        return self.key_cache[layer_idx].shape[-2]


class MusicgenSinusoidalPositionalEmbedding(nn.Module):
    def __init__(self, num_positions, embedding_dim):
        super().__init__()
        self.embedding_dim = embedding_dim
        half_dim = embedding_dim // 2
        emb = math.log(10000) / (half_dim - 1)
        emb = torch.exp(torch.arange(half_dim, dtype=torch.float64) * -emb)
        emb = torch.arange(num_positions, dtype=torch.float64).unsqueeze(1) * emb.unsqueeze(0)
        self.weights = torch.cat([torch.cos(emb), torch.sin(emb)], dim=1)  # float64, cast at use

    def forward(self, input_ids, past_key_values_length=0, dtype=torch.float32):
        bsz, seq_len = input_ids.shape
        position_ids = torch.arange(seq_len, device=input_ids.device) + past_key_values_length
        return self.weights.to(input_ids.device).index_select(0, position_ids.view(-1)).to(dtype)


class MusicgenAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, layer_idx):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.layer_idx = layer_idx
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=False)

    def forward(self, hidden_states, past_key_value=None, attention_mask=None):
        bsz, tgt_len, _ = hidden_states.shape
        shape = (bsz, -1, self.num_heads, self.head_dim)
        query_states = (self.q_proj(hidden_states) * self.scaling).view(shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        if past_key_value is not None:
            key_states, value_states = past_key_value.update(key_states, value_states, self.layer_idx)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3))
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask[:, :, :, : key_states.shape[-2]]
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).reshape(bsz, tgt_len, self.embed_dim)
        return self.out_proj(attn_output), None


class MusicgenDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = MusicgenAttention(config.hidden_size, config.num_attention_heads, layer_idx)
        self.self_attn_layer_norm = nn.LayerNorm(config.hidden_size)
        self.fc1 = nn.Linear(config.hidden_size, config.ffn_dim, bias=False)
        self.fc2 = nn.Linear(config.ffn_dim, config.hidden_size, bias=False)
        self.final_layer_norm = nn.LayerNorm(config.hidden_size)

    def forward(self, hidden_states, attention_mask=None, past_key_value=None):
        residual = hidden_states
        hidden_states, _ = self.self_attn(self.self_attn_layer_norm(hidden_states), past_key_value, attention_mask)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.fc2(F.gelu(self.fc1(self.final_layer_norm(hidden_states))))
        return residual + hidden_states


class MusicgenDecoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_codebooks = config.num_codebooks
        self.embed_tokens = nn.ModuleList(
            [nn.Embedding(config.vocab_size + 1, config.hidden_size) for _ in range(config.num_codebooks)]
        )
        self.embed_positions = MusicgenSinusoidalPositionalEmbedding(config.max_position_embeddings, config.hidden_size)
        self.layers = nn.ModuleList(
            [MusicgenDecoderLayer(config, layer_idx=i + 1) for i in range(config.num_hidden_layers)]
        )
        self.layer_norm = nn.LayerNorm(config.hidden_size)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        bsz, seq_len = input_ids.shape
        if use_cache and past_key_values is None:
            past_key_values = MusicgenCache()
        past_len = past_key_values.get_seq_length() if past_key_values is not None else 0
        inputs_embeds = sum(self.embed_tokens[c](input_ids) for c in range(self.num_codebooks))
        hidden_states = inputs_embeds + self.embed_positions(input_ids, past_len, dtype=inputs_embeds.dtype)
        dtype = hidden_states.dtype
        total = past_len + seq_len
        mask = torch.full((seq_len, total), torch.finfo(dtype).min, dtype=dtype, device=input_ids.device)
        mask = torch.triu(mask, diagonal=past_len + 1)
        mask = mask[None, None].expand(bsz, 1, seq_len, total)
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask=mask, past_key_value=past_key_values)
        return self.layer_norm(hidden_states), past_key_values


class MusicgenModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.decoder = MusicgenDecoder(config)


class MusicgenDecoderWrapper(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = MusicgenModel(config)


class MusicgenForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.decoder = MusicgenDecoderWrapper(config)
        self.lm_heads = nn.ModuleList(
            [nn.Linear(config.hidden_size, config.vocab_size, bias=False) for _ in range(config.num_codebooks)]
        )

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        hidden, cache = self.decoder.model.decoder(input_ids, past_key_values, use_cache)
        logits = self.lm_heads[0](hidden)
        return SimpleNamespace(logits=logits, past_key_values=cache if use_cache else None)


def make_model():
    torch.manual_seed(1513)
    config = SimpleNamespace(
        vocab_size=96, hidden_size=64, ffn_dim=128, num_hidden_layers=3, num_attention_heads=4,
        max_position_embeddings=128, num_codebooks=1,
    )
    model = MusicgenForCausalLM(config)
    g = torch.Generator().manual_seed(15131)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model.eval()

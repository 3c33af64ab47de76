"""MusicGen-Melody's decoder as a causal LM (transformers' modeling_musicgen_melody.py
MusicgenMelodyForCausalLM) with one codebook.

MusicgenMelodyForCausalLM: model.decoder (MusicgenMelodyDecoder: embed_tokens = ModuleList of one
Embedding per codebook (num_codebooks 1, inputs reshaped to (b, codebooks, s) and summed),
embed_positions (MusicgenMelodySinusoidalPositionalEmbedding: cos | sin halves, no offset, indexed by
past length + arange), layers.N, layer_norm), lm_heads (one per codebook; logits stacked and reshaped
to (b * codebooks, s, vocab) = (b, s, vocab)).  No cross-attention (melody conditioning is prepended
in the real model; none here).  MusicgenMelodyDecoderLayer is pre-norm: self_attn_layer_norm ->
self_attn -> + residual -> final_layer_norm -> fc1 / GELU / fc2 -> + residual.
MusicgenMelodyAttention: q/k/v/out_proj without bias, q_proj(h) * scaling, (b, h, s, d) matmul, additive
finfo.min mask with the past columns visible, softmax, out_proj.  MHA 4 x 16.
Cache: hf, a `MusicgenMelodyCache` object (update(k, v, layer_idx) concatenating on dim 2,
get_seq_length(), `seen_tokens` advanced by the decoder once per call and used for the positions),
created when use_cache=True and none is given: `out = model(ids, use_cache=True)`, then
`model(tok, past_key_values=out.past_key_values, use_cache=True)`; logits in `out.logits`.
Slip: the attention already stores its keys/values with past_key_value.update(...), and the decoder
loop, kept from the legacy tuple API, also calls past_key_values.update(*present, idx) with the
layer's new keys/values: every token is stored twice (the prompt included).  Positions come from
seen_tokens and the mask from the stored length, so only the duplicated cache is wrong.
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
        "model.decoder.layers.0.self_attn",
        "model.decoder.layers.1.self_attn",
        "model.decoder.layers.2.self_attn",
    ],
    "kind": "causal-multihead",
    "cache": "hf",
    "decode": {
        "mistake": "cache_stale",
        "step": 0,
        "layer": "model.decoder.layers.0.self_attn",
    },
    "style": "modeling_musicgen_melody.py MusicgenMelodyForCausalLM (1 codebook): cos|sin sinusoidal positions, pre-norm, "
    "q_proj*scaling, MusicgenMelodyCache object with seen_tokens; the decoder loop appends each layer's new k/v a "
    "second time (legacy present handling)",
}


class MusicgenMelodyCache:
    def __init__(self):
        self.key_cache = []
        self.value_cache = []
        self.seen_tokens = 0

    def update(self, key_states, value_states, layer_idx):
        if len(self.key_cache) <= layer_idx:
            self.key_cache.append(key_states)
            self.value_cache.append(value_states)
        else:
            self.key_cache[layer_idx] = torch.cat([self.key_cache[layer_idx], key_states], dim=2)
            self.value_cache[layer_idx] = torch.cat([self.value_cache[layer_idx], value_states], dim=2)
        return self.key_cache[layer_idx], self.value_cache[layer_idx]

    def get_seq_length(self, layer_idx=0):
        if len(self.key_cache) <= layer_idx:
            return 0
        return self.key_cache[layer_idx].shape[-2]


class MusicgenMelodySinusoidalPositionalEmbedding(nn.Module):
    def __init__(self, num_positions, embedding_dim):
        super().__init__()
        self.num_positions = num_positions
        self.embedding_dim = embedding_dim

    @staticmethod
    def get_embedding(num_embeddings, embedding_dim):
        half_dim = embedding_dim // 2
        emb = math.log(10000) / (half_dim - 1)
        emb = torch.exp(torch.arange(half_dim, dtype=torch.float64) * -emb)
        emb = torch.arange(num_embeddings, dtype=torch.float64).unsqueeze(1) * emb.unsqueeze(0)
        return torch.cat([torch.cos(emb), torch.sin(emb)], dim=1)

    def forward(self, inputs_embeds, past_key_values_length=0):
        bsz, seq_len, _ = inputs_embeds.size()
        weights = self.get_embedding(self.num_positions, self.embedding_dim).to(inputs_embeds.device)
        position_ids = (torch.arange(seq_len) + past_key_values_length).to(inputs_embeds.device)
        return weights.index_select(0, position_ids.view(-1)).to(inputs_embeds.dtype)


class MusicgenMelodyAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, layer_idx):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim**-0.5
        self.layer_idx = layer_idx
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=False)

    def forward(self, hidden_states, past_key_value=None, attention_mask=None):
        bsz, tgt_len, _ = hidden_states.size()
        q_input_shape = (bsz, tgt_len, -1, self.head_dim)
        query_states = (self.q_proj(hidden_states) * self.scaling).view(q_input_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(q_input_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(q_input_shape).transpose(1, 2)
        present = (key_states, value_states)
        if past_key_value is not None:
            key_states, value_states = past_key_value.update(key_states, value_states, self.layer_idx)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3))
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).reshape(bsz, tgt_len, self.embed_dim)
        return self.out_proj(attn_output), attn_weights, present


class MusicgenMelodyDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.embed_dim = config.hidden_size
        self.self_attn = MusicgenMelodyAttention(self.embed_dim, config.num_attention_heads, layer_idx)
        self.self_attn_layer_norm = nn.LayerNorm(self.embed_dim)
        self.fc1 = nn.Linear(self.embed_dim, config.ffn_dim, bias=False)
        self.fc2 = nn.Linear(config.ffn_dim, self.embed_dim, bias=False)
        self.final_layer_norm = nn.LayerNorm(self.embed_dim)

    def forward(self, hidden_states, attention_mask=None, past_key_value=None):
        residual = hidden_states
        hidden_states = self.self_attn_layer_norm(hidden_states)
        hidden_states, _, present = self.self_attn(
            hidden_states=hidden_states, past_key_value=past_key_value, attention_mask=attention_mask
        )
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.final_layer_norm(hidden_states)
        hidden_states = self.fc2(F.gelu(self.fc1(hidden_states)))
        return residual + hidden_states, present


class MusicgenMelodyDecoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_codebooks = config.num_codebooks
        self.embed_scale = math.sqrt(config.hidden_size) if config.scale_embedding else 1.0
        self.embed_tokens = nn.ModuleList(
            [nn.Embedding(config.vocab_size + 1, config.hidden_size) for _ in range(config.num_codebooks)]
        )
        self.embed_positions = MusicgenMelodySinusoidalPositionalEmbedding(config.max_position_embeddings, config.hidden_size)
        self.layers = nn.ModuleList([MusicgenMelodyDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.layer_norm = nn.LayerNorm(config.hidden_size)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        input = input_ids.reshape(-1, self.num_codebooks, input_ids.shape[-1])
        bsz, num_codebooks, seq_len = input.shape
        inputs_embeds = sum(self.embed_tokens[codebook](input[:, codebook]) for codebook in range(num_codebooks))
        inputs_embeds = inputs_embeds * self.embed_scale
        if use_cache and past_key_values is None:
            past_key_values = MusicgenMelodyCache()
        past_seen = past_key_values.seen_tokens if past_key_values is not None else 0
        kv_len = past_key_values.get_seq_length() if past_key_values is not None else 0
        positions = self.embed_positions(inputs_embeds, past_seen)
        hidden_states = inputs_embeds + positions
        dtype = hidden_states.dtype
        mask = torch.triu(torch.full((seq_len, seq_len), torch.finfo(dtype).min, dtype=dtype, device=input_ids.device), 1)
        if kv_len > 0:
            mask = torch.cat([torch.zeros(seq_len, kv_len, dtype=dtype, device=input_ids.device), mask], dim=-1)
        mask = mask[None, None].expand(bsz, 1, seq_len, kv_len + seq_len)
        for idx, decoder_layer in enumerate(self.layers):
            hidden_states, present = decoder_layer(hidden_states, attention_mask=mask, past_key_value=past_key_values)
            if use_cache:
                past_key_values.update(*present, idx)
        if past_key_values is not None:
            past_key_values.seen_tokens += seq_len
        return self.layer_norm(hidden_states), past_key_values


class MusicgenMelodyModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.decoder = MusicgenMelodyDecoder(config)


class MusicgenMelodyForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = MusicgenMelodyModel(config)
        self.num_codebooks = config.num_codebooks
        self.lm_heads = nn.ModuleList(
            [nn.Linear(config.hidden_size, config.vocab_size, bias=False) for _ in range(config.num_codebooks)]
        )

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        hidden_states, cache = self.model.decoder(input_ids, past_key_values=past_key_values, use_cache=use_cache)
        lm_logits = torch.stack([head(hidden_states) for head in self.lm_heads], dim=1)
        lm_logits = lm_logits.reshape(-1, *lm_logits.shape[2:])
        return SimpleNamespace(logits=lm_logits, past_key_values=cache if use_cache else None)


def make_model():
    torch.manual_seed(1611)
    config = SimpleNamespace(
        vocab_size=96,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        ffn_dim=128,
        max_position_embeddings=64,
        num_codebooks=1,
        scale_embedding=False,
    )
    model = MusicgenMelodyForCausalLM(config)
    g = torch.Generator().manual_seed(16111)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model.eval()

"""Whisper's text decoder used on its own as a causal LM (transformers modeling_whisper.py,
WhisperForCausalLM) -- the transformers code base, not openai/whisper's model.py.  The decoder's
cross-attention (encoder_attn) is not built: there is no audio encoder here.

model.decoder (WhisperDecoder: embed_tokens, embed_positions = WhisperPositionalEmbedding (learned,
sliced [past_key_values_length : past + seq]), layers.N, layer_norm) and proj_out (tied to
embed_tokens).  WhisperDecoderLayer is pre-norm: self_attn_layer_norm -> self_attn -> + residual,
final_layer_norm -> fc1 / gelu / fc2 -> + residual.  WhisperAttention: q_proj / v_proj / out_proj with
bias, k_proj without, eager matmul * scaling (head_dim ** -0.5), additive finfo.min causal mask with the
past columns visible (built from cache_position; dropped for one-token calls), softmax.  MHA 4 x 16.
Cache: hf cache object.  `WhisperDynamicCache` (per-layer key/value lists, update(key, value, layer_idx)
concatenating on dim -2, get_seq_length()):
`out = model(ids, use_cache=True)`, `model(tok, past_key_values=out.past_key_values, use_cache=True)`;
logits in `out.logits`.
Slip: WhisperAttention carries a "static cache warm-up" branch for single-token calls that writes the
new key/value into the cache before the regular update -- with a dynamic cache the regular
`update()` then appends them a second time, so from step 0 every decoded token attends to itself
twice (and the duplicates stay in the cache).  Positions come from get_seq_length() read before the
layers, so they are right at step 0.
"""

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
    "style": "modeling_whisper.py WhisperForCausalLM without cross-attention: learned positions sliced by the past "
    "length, pre-norm, k_proj without bias, eager attention, dynamic cache object; the single-token warm-up "
    "branch writes k/v before update() appends them again",
}


class WhisperDynamicCache:
    def __init__(self):
        self.key_cache = []
        self.value_cache = []

    def update(self, key_states, value_states, layer_idx):
        if len(self.key_cache) <= layer_idx:
            self.key_cache.append(key_states)
            self.value_cache.append(value_states)
        else:
            self.key_cache[layer_idx] = torch.cat([self.key_cache[layer_idx], key_states], dim=-2)
            self.value_cache[layer_idx] = torch.cat([self.value_cache[layer_idx], value_states], dim=-2)
        return self.key_cache[layer_idx], self.value_cache[layer_idx]

    def get_seq_length(self, layer_idx=0):
        if len(self.key_cache) <= layer_idx:
            return 0
        return self.key_cache[layer_idx].shape[-2]


class WhisperPositionalEmbedding(nn.Embedding):
    def forward(self, input_ids, past_key_values_length=0):
        return self.weight[past_key_values_length : past_key_values_length + input_ids.shape[1]]


class WhisperAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, layer_idx):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.layer_idx = layer_idx
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=True)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=True)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=True)

    def forward(self, hidden_states, past_key_value=None, attention_mask=None):
        bsz, tgt_len = hidden_states.shape[:-1]
        q_input_shape = (bsz, tgt_len, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(*q_input_shape).transpose(1, 2).contiguous()
        key_states = self.k_proj(hidden_states).view(bsz, -1, self.num_heads, self.head_dim).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(bsz, -1, self.num_heads, self.head_dim).transpose(1, 2)
        if past_key_value is not None:
            if tgt_len == 1:
                # static-cache warm-up: write the new token at its slot before reading the cache
                past_key_value.update(key_states, value_states, self.layer_idx)
            key_states, value_states = past_key_value.update(key_states, value_states, self.layer_idx)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.scaling
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask[:, :, :, : key_states.shape[-2]]
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, value_states).transpose(1, 2).contiguous()
        attn_output = attn_output.reshape(bsz, tgt_len, -1).contiguous()
        return self.out_proj(attn_output)


class WhisperDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.embed_dim = config.d_model
        self.self_attn = WhisperAttention(config.d_model, config.decoder_attention_heads, layer_idx)
        self.self_attn_layer_norm = nn.LayerNorm(self.embed_dim)
        self.fc1 = nn.Linear(self.embed_dim, config.decoder_ffn_dim)
        self.fc2 = nn.Linear(config.decoder_ffn_dim, self.embed_dim)
        self.final_layer_norm = nn.LayerNorm(self.embed_dim)

    def forward(self, hidden_states, attention_mask=None, past_key_value=None):
        residual = hidden_states
        hidden_states = self.self_attn(self.self_attn_layer_norm(hidden_states), past_key_value, attention_mask)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.fc2(F.gelu(self.fc1(self.final_layer_norm(hidden_states))))
        return residual + hidden_states


class WhisperDecoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model, config.pad_token_id)
        self.embed_positions = WhisperPositionalEmbedding(config.max_target_positions, config.d_model)
        self.layers = nn.ModuleList([WhisperDecoderLayer(config, i) for i in range(config.decoder_layers)])
        self.layer_norm = nn.LayerNorm(config.d_model)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        if use_cache and past_key_values is None:
            past_key_values = WhisperDynamicCache()
        past_key_values_length = past_key_values.get_seq_length() if past_key_values is not None else 0
        bsz, seq_len = input_ids.shape
        cache_position = torch.arange(past_key_values_length, past_key_values_length + seq_len,
                                      device=input_ids.device)
        inputs_embeds = self.embed_tokens(input_ids)
        positions = self.embed_positions(input_ids, past_key_values_length=past_key_values_length)
        hidden_states = inputs_embeds + positions.to(inputs_embeds.dtype)
        dtype = hidden_states.dtype
        target_length = past_key_values_length + seq_len
        kv_idx = torch.arange(target_length, device=input_ids.device)
        allowed = kv_idx[None, :] <= cache_position[:, None]
        causal_mask = torch.where(allowed, torch.zeros((), dtype=dtype),
                                  torch.tensor(torch.finfo(dtype).min, dtype=dtype))[None, None]
        causal_mask = causal_mask.expand(bsz, 1, -1, -1)
        if seq_len == 1:
            causal_mask = None  # one query sees every cached key: no mask needed
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(hidden_states, attention_mask=causal_mask, past_key_value=past_key_values)
        return self.layer_norm(hidden_states), (past_key_values if use_cache else None)


class WhisperDecoderWrapper(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.decoder = WhisperDecoder(config)


class WhisperForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = WhisperDecoderWrapper(config)
        self.proj_out = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.proj_out.weight = self.model.decoder.embed_tokens.weight

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        hidden, cache = self.model.decoder(input_ids, past_key_values=past_key_values, use_cache=use_cache)
        return SimpleNamespace(logits=self.proj_out(hidden), past_key_values=cache)


def make_model():
    torch.manual_seed(1911)
    config = SimpleNamespace(
        vocab_size=96, d_model=64, decoder_layers=3, decoder_attention_heads=4, decoder_ffn_dim=128,
        max_target_positions=64, pad_token_id=0,
    )
    model = WhisperForCausalLM(config)
    g = torch.Generator().manual_seed(19111)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
        model.model.decoder.embed_positions.weight.normal_(0.0, 0.5, generator=g)
    return model.eval()

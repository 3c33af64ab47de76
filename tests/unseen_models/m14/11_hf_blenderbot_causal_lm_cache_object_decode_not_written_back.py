"""BlenderbotForCausalLM (transformers' modeling_blenderbot.py, decoder used alone), reduced.

BlenderbotForCausalLM: model.decoder (BlenderbotDecoder: embed_tokens, embed_scale sqrt(d),
embed_positions = BlenderbotLearnedPositionalEmbedding (no offset), layers.N, layer_norm) and lm_head.
BlenderbotDecoderLayer is pre-norm (self_attn_layer_norm -> self_attn -> + residual ->
final_layer_norm -> fc1/gelu/fc2 -> + residual); no cross-attention is built.  BlenderbotAttention:
q_proj/k_proj/v_proj/out_proj with bias, q_proj(h) * scaling, (bsz * heads, len, d) bmm, MHA 4 x 16,
additive causal mask (finfo.min) from cache_position; on one-token steps no mask is built.
Cache: hf, a `BlenderbotCache` object (key_cache/value_cache per layer (b, h, s, d), cat on dim 2,
`_seen_tokens` counter for positions).  Drive: `out = model(ids, use_cache=True)`, then
`model(tok, past_key_values=out.past_key_values, use_cache=True)`; logits in `out.logits`.
Slip: `BlenderbotCache.update` has a one-token "fast path" that returns the concatenation to the
caller but never stores it back, so each decoded token is attended at its own step and then lost.
Step 0 is exact; from step 1 the previous decoded token is missing from every layer's keys/values.
Positions (from `_seen_tokens`) are right.
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
        "step": 1,
        "layer": "model.decoder.layers.0.self_attn",
    },
    "style": "modeling_blenderbot.py BlenderbotForCausalLM: embed_scale, learned positions, pre-norm, (bsz*heads) bmm, "
    "cache object with _seen_tokens; slip: one-token update returns the concatenation without storing it",
}


class BlenderbotCache:
    def __init__(self):
        self.key_cache = []
        self.value_cache = []
        self._seen_tokens = 0

    def get_seq_length(self, layer_idx=0):
        return self._seen_tokens

    def update(self, key_states, value_states, layer_idx):
        if layer_idx == 0:
            self._seen_tokens += key_states.shape[-2]
        if len(self.key_cache) <= layer_idx:
            self.key_cache.append(key_states)
            self.value_cache.append(value_states)
            return key_states, value_states
        if key_states.shape[-2] == 1:
            # "fast path": no write-back
            return (torch.cat([self.key_cache[layer_idx], key_states], dim=-2),
                    torch.cat([self.value_cache[layer_idx], value_states], dim=-2))
        self.key_cache[layer_idx] = torch.cat([self.key_cache[layer_idx], key_states], dim=-2)
        self.value_cache[layer_idx] = torch.cat([self.value_cache[layer_idx], value_states], dim=-2)
        return self.key_cache[layer_idx], self.value_cache[layer_idx]


class BlenderbotLearnedPositionalEmbedding(nn.Embedding):
    def forward(self, input_ids_shape, past_key_values_length=0):
        seq_len = input_ids_shape[1]
        positions = torch.arange(past_key_values_length, past_key_values_length + seq_len, dtype=torch.long)
        return super().forward(positions)


class BlenderbotAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, layer_idx):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.layer_idx = layer_idx
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def _shape(self, tensor, seq_len, bsz):
        return tensor.view(bsz, seq_len, self.num_heads, self.head_dim).transpose(1, 2).contiguous()

    def forward(self, hidden_states, past_key_value=None, attention_mask=None):
        bsz, tgt_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states) * self.scaling
        key_states = self._shape(self.k_proj(hidden_states), -1, bsz)
        value_states = self._shape(self.v_proj(hidden_states), -1, bsz)
        if past_key_value is not None:
            key_states, value_states = past_key_value.update(key_states, value_states, self.layer_idx)
        proj_shape = (bsz * self.num_heads, -1, self.head_dim)
        query_states = self._shape(query_states, tgt_len, bsz).view(*proj_shape)
        key_states = key_states.reshape(*proj_shape)
        value_states = value_states.reshape(*proj_shape)
        src_len = key_states.size(1)
        attn_weights = torch.bmm(query_states, key_states.transpose(1, 2))
        if attention_mask is not None:
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len) + attention_mask
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_output = torch.bmm(attn_weights, value_states)
        attn_output = attn_output.view(bsz, self.num_heads, tgt_len, self.head_dim).transpose(1, 2)
        attn_output = attn_output.reshape(bsz, tgt_len, self.embed_dim)
        return self.out_proj(attn_output)


class BlenderbotDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.embed_dim = config.d_model
        self.self_attn = BlenderbotAttention(config.d_model, config.decoder_attention_heads, layer_idx)
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


class BlenderbotDecoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_scale = math.sqrt(config.d_model) if config.scale_embedding else 1.0
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.embed_positions = BlenderbotLearnedPositionalEmbedding(config.max_position_embeddings, config.d_model)
        self.layers = nn.ModuleList(BlenderbotDecoderLayer(config, i) for i in range(config.decoder_layers))
        self.layer_norm = nn.LayerNorm(config.d_model)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        if use_cache and past_key_values is None:
            past_key_values = BlenderbotCache()
        past_len = past_key_values.get_seq_length() if past_key_values is not None else 0
        bsz, tgt_len = input_ids.shape
        inputs_embeds = self.embed_tokens(input_ids) * self.embed_scale
        if tgt_len > 1:
            cache_position = torch.arange(past_len, past_len + tgt_len)
            blocked = torch.arange(past_len + tgt_len)[None, :] > cache_position[:, None]
            attention_mask = torch.zeros(blocked.shape, dtype=inputs_embeds.dtype).masked_fill(
                blocked, torch.finfo(inputs_embeds.dtype).min)[None, None]
        else:
            attention_mask = None
        positions = self.embed_positions(input_ids.shape, past_len)
        hidden_states = inputs_embeds + positions
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask, past_key_values)
        return self.layer_norm(hidden_states), past_key_values


class BlenderbotDecoderWrapper(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.decoder = BlenderbotDecoder(config)


class BlenderbotForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = BlenderbotDecoderWrapper(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        hidden, cache = self.model.decoder(input_ids, past_key_values, use_cache)
        return SimpleNamespace(logits=self.lm_head(hidden), past_key_values=cache if use_cache else None)


def make_model():
    torch.manual_seed(1411)
    config = SimpleNamespace(vocab_size=96, d_model=64, decoder_layers=3, decoder_attention_heads=4,
                             decoder_ffn_dim=128, max_position_embeddings=64, scale_embedding=True)
    model = BlenderbotForCausalLM(config)
    g = torch.Generator().manual_seed(14111)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
        model.model.decoder.embed_positions.weight.normal_(0.0, 1.0, generator=g)
        model.model.decoder.embed_tokens.weight.mul_(0.125)
    return model.eval()

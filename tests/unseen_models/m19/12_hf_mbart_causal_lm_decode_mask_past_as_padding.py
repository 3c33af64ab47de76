"""mBART decoder used on its own as a causal LM (transformers modeling_mbart.py, MBartForCausalLM; no
encoder, so the decoder layers' encoder_attn is not built).

model.decoder (MBartDecoder: embed_tokens with embed_scale sqrt(d), embed_positions =
MBartLearnedPositionalEmbedding (offset 2, positions past .. past + seq), layernorm_embedding,
layers.N, layer_norm at the end) and lm_head.  MBartDecoderLayer is pre-norm:
self_attn_layer_norm -> self_attn -> + residual, final_layer_norm -> fc1 / gelu / fc2 -> + residual.
MBartAttention: q/k/v/out_proj with bias, q_proj(h) * scaling, (bsz * heads, len, hd) bmm, legacy
(k, v) tuple cache in (b, h, s, d) concatenated on dim 2, additive 4-D mask.  MHA 4 x 16.
Cache: hf tuples: `out = model(ids, use_cache=True)`, `model(tok, past_key_values=out.past_key_values,
use_cache=True)`; logits in `out.logits`.
Slip: when no attention_mask is passed, MBartForCausalLM makes a default `ones(bsz, seq_len)` for the
*current* tokens only; `_prepare_4d_causal_attention_mask` then expands that 2-D padding mask to the
key length by padding it on the left with zeros -- as if the cached tokens were left padding -- so on
every one-token step the new token sees only itself.  The full forward and the prompt pass have no
past and are exact.
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
        "mistake": "cache_mask",
        "step": 0,
        "layer": "model.decoder.layers.0.self_attn",
    },
    "style": "modeling_mbart.py MBartForCausalLM: embed_scale, offset-2 learned positions, layernorm_embedding, "
    "pre-norm with final layer_norm, (bsz*heads) bmm attention, legacy (k, v) tuples; the default padding "
    "mask covers only the new tokens and is left-padded with zeros over the past",
}


class MBartLearnedPositionalEmbedding(nn.Embedding):
    def __init__(self, num_embeddings, embedding_dim):
        self.offset = 2
        super().__init__(num_embeddings + self.offset, embedding_dim)

    def forward(self, input_ids, past_key_values_length=0):
        bsz, seq_len = input_ids.shape[:2]
        positions = torch.arange(past_key_values_length, past_key_values_length + seq_len,
                                 dtype=torch.long, device=self.weight.device).expand(bsz, -1)
        return super().forward(positions + self.offset)


def _prepare_4d_causal_attention_mask(attention_mask, input_shape, dtype, past_key_values_length):
    bsz, tgt_len = input_shape
    key_value_length = tgt_len + past_key_values_length
    min_value = torch.finfo(dtype).min
    causal = torch.full((tgt_len, tgt_len), min_value, dtype=dtype)
    causal = torch.triu(causal, diagonal=1)
    if past_key_values_length > 0:
        causal = torch.cat([torch.zeros(tgt_len, past_key_values_length, dtype=dtype), causal], dim=-1)
    causal = causal[None, None].expand(bsz, 1, tgt_len, key_value_length)
    if attention_mask is not None:
        if attention_mask.shape[-1] < key_value_length:
            # a 2-D mask shorter than the keys: treat the missing leading columns as left padding
            pad = key_value_length - attention_mask.shape[-1]
            attention_mask = F.pad(attention_mask, (pad, 0), value=0)
        expanded = attention_mask[:, None, None, :].expand(bsz, 1, tgt_len, key_value_length).to(dtype)
        inverted = (1.0 - expanded).masked_fill((1.0 - expanded).bool(), min_value)
        causal = causal.masked_fill(inverted.bool(), min_value)
    return causal


class MBartAttention(nn.Module):
    def __init__(self, embed_dim, num_heads):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
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
            key_states = torch.cat([past_key_value[0], key_states], dim=2)
            value_states = torch.cat([past_key_value[1], value_states], dim=2)
        past_key_value = (key_states, value_states)
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
        return self.out_proj(attn_output), past_key_value


class MBartDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = MBartAttention(config.d_model, config.decoder_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(config.d_model)
        self.fc1 = nn.Linear(config.d_model, config.decoder_ffn_dim)
        self.fc2 = nn.Linear(config.decoder_ffn_dim, config.d_model)
        self.final_layer_norm = nn.LayerNorm(config.d_model)

    def forward(self, hidden_states, attention_mask=None, past_key_value=None):
        residual = hidden_states
        hidden_states, present = self.self_attn(self.self_attn_layer_norm(hidden_states), past_key_value,
                                                attention_mask)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.fc2(F.gelu(self.fc1(self.final_layer_norm(hidden_states))))
        return residual + hidden_states, present


class MBartDecoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_scale = math.sqrt(config.d_model) if config.scale_embedding else 1.0
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model, config.pad_token_id)
        self.embed_positions = MBartLearnedPositionalEmbedding(config.max_position_embeddings, config.d_model)
        self.layers = nn.ModuleList([MBartDecoderLayer(config) for _ in range(config.decoder_layers)])
        self.layernorm_embedding = nn.LayerNorm(config.d_model)
        self.layer_norm = nn.LayerNorm(config.d_model)

    def forward(self, input_ids, attention_mask=None, past_key_values=None, use_cache=False):
        bsz, seq_len = input_ids.shape
        past_key_values_length = past_key_values[0][0].shape[2] if past_key_values is not None else 0
        inputs_embeds = self.embed_tokens(input_ids) * self.embed_scale
        attention_mask = _prepare_4d_causal_attention_mask(
            attention_mask, (bsz, seq_len), inputs_embeds.dtype, past_key_values_length
        )
        positions = self.embed_positions(input_ids, past_key_values_length)
        hidden_states = self.layernorm_embedding(inputs_embeds + positions.to(inputs_embeds.dtype))
        next_cache = ()
        for idx, layer in enumerate(self.layers):
            past = past_key_values[idx] if past_key_values is not None else None
            hidden_states, present = layer(hidden_states, attention_mask=attention_mask, past_key_value=past)
            next_cache += (present,)
        return self.layer_norm(hidden_states), (next_cache if use_cache else None)


class MBartDecoderWrapper(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.decoder = MBartDecoder(config)


class MBartForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = MBartDecoderWrapper(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)

    def forward(self, input_ids, attention_mask=None, past_key_values=None, use_cache=False):
        if attention_mask is None:
            attention_mask = torch.ones(input_ids.shape, dtype=torch.long, device=input_ids.device)
        hidden, cache = self.model.decoder(input_ids, attention_mask=attention_mask,
                                           past_key_values=past_key_values, use_cache=use_cache)
        return SimpleNamespace(logits=self.lm_head(hidden), past_key_values=cache)


def make_model():
    torch.manual_seed(1912)
    config = SimpleNamespace(
        vocab_size=96, d_model=64, decoder_layers=3, decoder_attention_heads=4, decoder_ffn_dim=128,
        max_position_embeddings=64, scale_embedding=True, pad_token_id=1,
    )
    model = MBartForCausalLM(config)
    g = torch.Generator().manual_seed(19121)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
        model.model.decoder.embed_positions.weight.normal_(0.0, 1.0, generator=g)
    return model.eval()

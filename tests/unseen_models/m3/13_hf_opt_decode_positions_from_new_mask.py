"""A tiny OPT in the style of modeling_opt.py (pre-2024 layout, legacy tuple cache).

OPTForCausalLM -> model.decoder (embed_tokens, embed_positions with the offset of 2, layers
ModuleList, final_layer_norm) + tied lm_head.  do_layer_norm_before=True.  OPTAttention: q_proj,
k_proj, v_proj, out_proj with bias; the query is multiplied by `scaling` = head_dim ** -0.5 right
after its projection; states in the fairseq (bsz * heads, len, head_dim) bmm layout; additive
causal mask with finfo.min, combined with the padding mask; fp32-style clamp skipped.
Learned positions come from attention_mask.cumsum(1) (so padding is skipped) and are the last
seq_len of them.

Cache (hf): past_key_values is a tuple of per-layer (key, value), each (bsz, heads, len, head_dim).
model(ids, use_cache=True) -> .past_key_values; model(tok, past_key_values=..., use_cache=True).
Slip (decoding only): the positional embedding is handed the mask of the fed tokens only,
attention_mask[:, -seq_length:], so the cumsum restarts at every call.  The full forward and the
prompt pass are exact; every decoded token gets learned position 0 (+ offset 2) instead of its
cache length.  First divergent attention at step 0: model.decoder.layers.0.self_attn (its input
already carries the wrong position embedding): cache_positions.
"""

from dataclasses import dataclass
from typing import Optional, Tuple

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
        "mistake": "cache_positions",
        "step": 0,
        "layer": "model.decoder.layers.0.self_attn",
    },
    "style": "transformers modeling_opt.py: OPTLearnedPositionalEmbedding (offset 2, cumsum of the mask), "
    "query scaled after projection, bmm over (bsz*heads), legacy (k, v) tuple cache; slip: positions from the mask of the new tokens only",
}


@dataclass
class OPTConfig:
    vocab_size: int = 192
    hidden_size: int = 48
    num_hidden_layers: int = 3
    num_attention_heads: int = 6
    ffn_dim: int = 96
    max_position_embeddings: int = 64


@dataclass
class CausalLMOutputWithPast:
    logits: torch.Tensor
    past_key_values: Optional[Tuple] = None


class OPTLearnedPositionalEmbedding(nn.Embedding):
    def __init__(self, num_embeddings, embedding_dim):
        self.offset = 2
        super().__init__(num_embeddings + self.offset, embedding_dim)

    def forward(self, attention_mask, seq_len):
        attention_mask = attention_mask.long()
        positions = (
            torch.cumsum(attention_mask, dim=1).type_as(attention_mask) * attention_mask
        ).long() - 1
        positions = positions[:, -seq_len:]
        return super().forward(positions + self.offset)


class OPTAttention(nn.Module):
    def __init__(self, embed_dim, num_heads):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim**-0.5
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
        key_states = key_states.view(*proj_shape)
        value_states = value_states.view(*proj_shape)
        src_len = key_states.size(1)
        attn_weights = torch.bmm(query_states, key_states.transpose(1, 2))
        attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len) + attention_mask
        attn_weights = torch.max(
            attn_weights,
            torch.tensor(torch.finfo(attn_weights.dtype).min, dtype=attn_weights.dtype),
        )
        attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)
        attn_probs = F.softmax(attn_weights, dim=-1)
        attn_output = torch.bmm(attn_probs, value_states)
        attn_output = attn_output.view(bsz, self.num_heads, tgt_len, self.head_dim).transpose(1, 2)
        attn_output = attn_output.reshape(bsz, tgt_len, self.embed_dim)
        return self.out_proj(attn_output), past_key_value


class OPTDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = OPTAttention(config.hidden_size, config.num_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(config.hidden_size)
        self.fc1 = nn.Linear(config.hidden_size, config.ffn_dim)
        self.fc2 = nn.Linear(config.ffn_dim, config.hidden_size)
        self.final_layer_norm = nn.LayerNorm(config.hidden_size)

    def forward(self, hidden_states, attention_mask=None, past_key_value=None):
        residual = hidden_states
        hidden_states = self.self_attn_layer_norm(hidden_states)
        hidden_states, present = self.self_attn(
            hidden_states, past_key_value=past_key_value, attention_mask=attention_mask
        )
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.fc2(F.relu(self.fc1(self.final_layer_norm(hidden_states))))
        return residual + hidden_states, present


class OPTDecoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_positions = OPTLearnedPositionalEmbedding(
            config.max_position_embeddings, config.hidden_size
        )
        self.layers = nn.ModuleList(
            [OPTDecoderLayer(config) for _ in range(config.num_hidden_layers)]
        )
        self.final_layer_norm = nn.LayerNorm(config.hidden_size)

    def _prepare_decoder_attention_mask(
        self, attention_mask, input_shape, dtype, past_key_values_length
    ):
        bsz, tgt_len = input_shape
        min_val = torch.finfo(dtype).min
        src_len = past_key_values_length + tgt_len
        q_pos = torch.arange(past_key_values_length, src_len, device=attention_mask.device)[:, None]
        k_pos = torch.arange(src_len, device=attention_mask.device)[None, :]
        causal = torch.zeros(tgt_len, src_len, dtype=dtype, device=attention_mask.device)
        causal = causal.masked_fill(k_pos > q_pos, min_val)
        expanded = (1.0 - attention_mask[:, None, None, :].to(dtype)) * min_val
        return (causal[None, None] + expanded).clamp(min=min_val)

    def forward(self, input_ids, attention_mask=None, past_key_values=None, use_cache=False):
        bsz, seq_length = input_ids.shape
        past_key_values_length = (
            past_key_values[0][0].shape[2] if past_key_values is not None else 0
        )
        inputs_embeds = self.embed_tokens(input_ids)
        mask_seq_length = past_key_values_length + seq_length
        if attention_mask is None:
            attention_mask = torch.ones(bsz, mask_seq_length, device=input_ids.device)
        causal_attention_mask = self._prepare_decoder_attention_mask(
            attention_mask, (bsz, seq_length), inputs_embeds.dtype, past_key_values_length
        )
        # positions from the mask of the tokens being fed (the new ones only)
        pos_embeds = self.embed_positions(attention_mask[:, -seq_length:], seq_length)  # SLIP
        hidden_states = inputs_embeds + pos_embeds
        next_cache = () if use_cache else None
        for idx, decoder_layer in enumerate(self.layers):
            past_key_value = past_key_values[idx] if past_key_values is not None else None
            hidden_states, present = decoder_layer(
                hidden_states, attention_mask=causal_attention_mask, past_key_value=past_key_value
            )
            if use_cache:
                next_cache += (present,)
        return self.final_layer_norm(hidden_states), next_cache


class OPTModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.decoder = OPTDecoder(config)


class OPTForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = OPTModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.lm_head.weight = self.model.decoder.embed_tokens.weight

    def forward(self, input_ids, attention_mask=None, past_key_values=None, use_cache=False):
        hidden_states, next_cache = self.model.decoder(
            input_ids,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            use_cache=use_cache,
        )
        return CausalLMOutputWithPast(
            logits=self.lm_head(hidden_states), past_key_values=next_cache
        )


def make_model():
    torch.manual_seed(4)
    model = OPTForCausalLM(OPTConfig())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.25 * torch.randn_like(m.weight))
                m.bias.copy_(0.05 * torch.randn_like(m.bias))
    return model.eval()

"""BioGPT (modeling_biogpt.py) causal LM with an hf cache object.

biogpt.embed_tokens * embed_scale (sqrt(d)), BioGptLearnedPositionalEmbedding (offset 2, positions
past_length .. past_length + T - 1), pre-norm BioGptDecoderLayer (self_attn_layer_norm, self_attn,
final_layer_norm, fc1/fc2 gelu), biogpt.layer_norm, untied output_projection.  BioGptAttention is
BART's: q_proj(h) * scaling, (bsz*heads, len, hd) bmm, additive finfo.min mask, out_proj.  The
cache (BioGptCache) keeps per-layer key/value lists (b, h, s, d), update(k, v, layer_idx),
get_seq_length() from the stored keys (used for the mask) and a seen_tokens counter (used for the
positions).  Slip: the model sets cache.seen_tokens = T after each call instead of adding T, so the
prompt's length is right at the first one-token step and every later step is placed at position 1.
hf: model(ids, use_cache=True), then model(tok, past_key_values=out.past_key_values, use_cache=True).
"""

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": [
        "biogpt.layers.0.self_attn",
        "biogpt.layers.1.self_attn",
        "biogpt.layers.2.self_attn",
    ],
    "kind": "causal-multihead",
    "cache": "hf",
    "decode": {"mistake": "cache_positions", "step": 1, "layer": "biogpt.layers.0.self_attn"},
    "style": "modeling_biogpt.py: scaled embeddings, offset-2 learned positions, pre-norm, BART-style attention (q*scaling, "
    "(bsz*heads) bmm, finfo.min mask), BioGptCache with seen_tokens; slip: seen_tokens = T instead of += T",
}


class BioGptConfig:
    vocab_size = 105
    hidden_size = 64
    num_hidden_layers = 3
    num_attention_heads = 4
    intermediate_size = 160
    max_position_embeddings = 64
    scale_embedding = True
    layer_norm_eps = 1e-12


class BioGptCache:
    def __init__(self):
        self.key_cache = []
        self.value_cache = []
        self.seen_tokens = 0

    def update(self, key_states, value_states, layer_idx):
        if len(self.key_cache) <= layer_idx:
            self.key_cache.append(key_states)
            self.value_cache.append(value_states)
        else:
            self.key_cache[layer_idx] = torch.cat([self.key_cache[layer_idx], key_states], dim=-2)
            self.value_cache[layer_idx] = torch.cat(
                [self.value_cache[layer_idx], value_states], dim=-2
            )
        return self.key_cache[layer_idx], self.value_cache[layer_idx]

    def get_seq_length(self, layer_idx=0):
        if len(self.key_cache) <= layer_idx:
            return 0
        return self.key_cache[layer_idx].shape[-2]


class BioGptLearnedPositionalEmbedding(nn.Embedding):
    def __init__(self, num_embeddings, embedding_dim):
        self.offset = 2
        super().__init__(num_embeddings + self.offset, embedding_dim)

    def forward(self, attention_mask, past_key_values_length=0):
        positions = (
            torch.cumsum(attention_mask, dim=1).type_as(attention_mask) * attention_mask
        ).long() - 1
        positions = positions + past_key_values_length
        return super().forward(positions + self.offset)


class BioGptAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, layer_idx):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim**-0.5
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
            key_states, value_states = past_key_value.update(
                key_states, value_states, self.layer_idx
            )
        proj_shape = (bsz * self.num_heads, -1, self.head_dim)
        query_states = self._shape(query_states, tgt_len, bsz).view(*proj_shape)
        key_states = key_states.reshape(*proj_shape)
        value_states = value_states.reshape(*proj_shape)
        src_len = key_states.size(1)
        attn_weights = torch.bmm(query_states, key_states.transpose(1, 2))
        if attention_mask is not None:
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len) + attention_mask
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_output = torch.bmm(attn_weights, value_states)
        attn_output = attn_output.view(bsz, self.num_heads, tgt_len, self.head_dim).transpose(1, 2)
        attn_output = attn_output.reshape(bsz, tgt_len, self.embed_dim)
        return self.out_proj(attn_output), None


class BioGptDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = BioGptAttention(config.hidden_size, config.num_attention_heads, layer_idx)
        self.self_attn_layer_norm = nn.LayerNorm(config.hidden_size)
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.final_layer_norm = nn.LayerNorm(config.hidden_size)

    def forward(self, hidden_states, attention_mask=None, past_key_value=None):
        residual = hidden_states
        hidden_states = self.self_attn_layer_norm(hidden_states)
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states,
            past_key_value=past_key_value,
            attention_mask=attention_mask,
        )
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.fc2(F.gelu(self.fc1(self.final_layer_norm(hidden_states))))
        return residual + hidden_states


class BioGptModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_scale = config.hidden_size**0.5 if config.scale_embedding else 1.0
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_positions = BioGptLearnedPositionalEmbedding(
            config.max_position_embeddings, config.hidden_size
        )
        self.layers = nn.ModuleList(
            [BioGptDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.layer_norm = nn.LayerNorm(config.hidden_size)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        bsz, seq_length = input_ids.shape
        if use_cache and past_key_values is None:
            past_key_values = BioGptCache()
        past_key_values_length = (
            past_key_values.get_seq_length() if past_key_values is not None else 0
        )
        position_offset = past_key_values.seen_tokens if past_key_values is not None else 0
        inputs_embeds = self.embed_tokens(input_ids) * self.embed_scale
        attention_mask = torch.ones(bsz, seq_length, dtype=torch.long, device=input_ids.device)
        positions = self.embed_positions(attention_mask, position_offset)
        hidden_states = inputs_embeds + positions
        dtype = hidden_states.dtype
        full = past_key_values_length + seq_length
        q_pos = torch.arange(past_key_values_length, full, device=input_ids.device)[:, None]
        k_pos = torch.arange(full, device=input_ids.device)[None, :]
        causal_mask = torch.zeros(seq_length, full, dtype=dtype, device=input_ids.device)
        causal_mask = causal_mask.masked_fill(k_pos > q_pos, torch.finfo(dtype).min)[None, None]
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(
                hidden_states,
                attention_mask=causal_mask,
                past_key_value=past_key_values if use_cache else None,
            )
        if use_cache:
            past_key_values.seen_tokens = seq_length
        return self.layer_norm(hidden_states), (past_key_values if use_cache else None)


@dataclass
class CausalLMOutputWithPast:
    logits: torch.Tensor
    past_key_values: Optional[BioGptCache] = None


class BioGptForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.biogpt = BioGptModel(config)
        self.output_projection = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        hidden, cache = self.biogpt(input_ids, past_key_values=past_key_values, use_cache=use_cache)
        return CausalLMOutputWithPast(logits=self.output_projection(hidden), past_key_values=cache)


def make_model():
    torch.manual_seed(711)
    model = BioGptForCausalLM(BioGptConfig())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Linear):
                m.weight.normal_(0.0, 0.08)
                if m.bias is not None:
                    m.bias.normal_(0.0, 0.05)
            elif isinstance(m, nn.Embedding):
                m.weight.normal_(0.0, 0.1)
            elif isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn_like(m.weight))
                m.bias.copy_(0.1 * torch.randn_like(m.bias))
        model.biogpt.embed_positions.weight.normal_(0.0, 0.5)
    return model.eval()

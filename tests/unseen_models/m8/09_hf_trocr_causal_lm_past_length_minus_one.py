"""TrOCR text decoder used on its own as a causal LM, after transformers' modeling_trocr.py.

TrOCRForCausalLM: model.decoder (TrOCRDecoder: embed_tokens, embed_scale sqrt(d) (scale_embedding),
embed_positions = TrOCRLearnedPositionalEmbedding (offset 2), layernorm_embedding, layers.N), and
output_projection.  TrOCRDecoderLayer is post-norm (self_attn -> + residual -> self_attn_layer_norm
-> fc1/fc2 -> + residual -> final_layer_norm); the cross-attention of the image-to-text model is not
built (add_cross_attention False).  TrOCRAttention: q_proj/k_proj/v_proj/out_proj with bias,
q_proj(h) * scaling, (bsz * heads, len, hd) bmm, legacy tuple cache (k, v) in (b, h, s, d) concatenated
on dim 2, additive causal mask (finfo.min) with the past columns visible.
Cache: hf tuples: `out = model(ids, use_cache=True)`, then
`model(tok, past_key_values=out.past_key_values, use_cache=True)`; logits in `out.logits`.
Slip: the decoder reads the past length for the learned positions as
`past_key_values[0][0].shape[2] - 1` (written for an export whose cache already held the current
token), so every decoded token is embedded at the position of the token before it.  The mask and the
keys are built from the real lengths.  Full forward and the prompt pass are exact.
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
        "mistake": "cache_positions",
        "step": 0,
        "layer": "model.decoder.layers.0.self_attn",
    },
    "style": "modeling_trocr.py TrOCRForCausalLM: embed_scale, offset-2 learned positions, layernorm_embedding, "
    "post-norm, (bsz*heads) bmm attention, legacy (k, v) tuples; slip: past length for positions read as "
    "past_key_values[0][0].shape[2] - 1",
}


class TrOCRLearnedPositionalEmbedding(nn.Embedding):
    def __init__(self, num_embeddings, embedding_dim):
        self.offset = 2
        super().__init__(num_embeddings + self.offset, embedding_dim)

    def forward(self, input_ids, past_key_values_length=0):
        bsz, seq_len = input_ids.shape[:2]
        positions = torch.arange(
            past_key_values_length,
            past_key_values_length + seq_len,
            dtype=torch.long,
            device=self.weight.device,
        ).expand(bsz, -1)
        return super().forward(positions + self.offset)


class TrOCRAttention(nn.Module):
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
        bsz, tgt_len, embed_dim = hidden_states.size()
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
        attn_output = attn_output.reshape(bsz, tgt_len, embed_dim)
        return self.out_proj(attn_output), None, past_key_value


class TrOCRDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = TrOCRAttention(config.hidden_size, config.decoder_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(config.hidden_size)
        self.fc1 = nn.Linear(config.hidden_size, config.decoder_ffn_dim)
        self.fc2 = nn.Linear(config.decoder_ffn_dim, config.hidden_size)
        self.final_layer_norm = nn.LayerNorm(config.hidden_size)

    def forward(self, hidden_states, attention_mask=None, past_key_value=None):
        residual = hidden_states
        hidden_states, _, present = self.self_attn(
            hidden_states=hidden_states,
            past_key_value=past_key_value,
            attention_mask=attention_mask,
        )
        hidden_states = self.self_attn_layer_norm(residual + hidden_states)
        residual = hidden_states
        hidden_states = self.fc2(F.gelu(self.fc1(hidden_states)))
        hidden_states = self.final_layer_norm(residual + hidden_states)
        return hidden_states, present


class TrOCRDecoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_scale = math.sqrt(config.hidden_size) if config.scale_embedding else 1.0
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.embed_positions = TrOCRLearnedPositionalEmbedding(
            config.max_position_embeddings, config.hidden_size
        )
        self.layernorm_embedding = nn.LayerNorm(config.hidden_size)
        self.layers = nn.ModuleList(
            [TrOCRDecoderLayer(config) for _ in range(config.decoder_layers)]
        )

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        bsz, seq_len = input_ids.shape
        kv_len = past_key_values[0][0].shape[2] if past_key_values is not None else 0
        past_key_values_length = (
            past_key_values[0][0].shape[2] - 1 if past_key_values is not None else 0
        )
        inputs_embeds = self.embed_tokens(input_ids) * self.embed_scale
        embed_pos = self.embed_positions(input_ids, past_key_values_length=past_key_values_length)
        hidden_states = self.layernorm_embedding(inputs_embeds + embed_pos)
        dtype = hidden_states.dtype
        mask = torch.full(
            (seq_len, seq_len), torch.finfo(dtype).min, dtype=dtype, device=input_ids.device
        )
        mask = torch.triu(mask, diagonal=1)
        if kv_len > 0:
            mask = torch.cat(
                [torch.zeros(seq_len, kv_len, dtype=dtype, device=input_ids.device), mask], dim=-1
            )
        mask = mask[None, None].expand(bsz, 1, seq_len, seq_len + kv_len)
        next_cache = ()
        for idx, layer in enumerate(self.layers):
            past = past_key_values[idx] if past_key_values is not None else None
            hidden_states, present = layer(hidden_states, attention_mask=mask, past_key_value=past)
            next_cache += (present,)
        return hidden_states, (next_cache if use_cache else None)


class TrOCRDecoderWrapper(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.decoder = TrOCRDecoder(config)


class TrOCRForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = TrOCRDecoderWrapper(config)
        self.output_projection = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        hidden, cache = self.model.decoder(
            input_ids, past_key_values=past_key_values, use_cache=use_cache
        )
        return SimpleNamespace(logits=self.output_projection(hidden), past_key_values=cache)


def make_model():
    torch.manual_seed(809)
    config = SimpleNamespace(
        vocab_size=110,
        hidden_size=64,
        decoder_layers=3,
        decoder_attention_heads=4,
        decoder_ffn_dim=128,
        max_position_embeddings=64,
        scale_embedding=True,
        pad_token_id=1,
    )
    model = TrOCRForCausalLM(config)
    g = torch.Generator().manual_seed(8091)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
        model.model.decoder.embed_positions.weight.normal_(0.0, 1.0, generator=g)
    return model.eval()

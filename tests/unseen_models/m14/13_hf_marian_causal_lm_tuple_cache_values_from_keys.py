"""MarianForCausalLM (transformers' modeling_marian.py, the decoder used alone), reduced.

MarianForCausalLM: model.decoder (MarianDecoder: embed_tokens, embed_scale sqrt(d),
embed_positions = MarianSinusoidalPositionalEmbedding (no offset; sin in the first half, cos in the
second, float64 then cast), layers.N) and lm_head with final_logits_bias.  MarianDecoderLayer is
post-norm (self_attn -> + residual -> self_attn_layer_norm -> fc1/swish/fc2 -> + residual ->
final_layer_norm); no cross-attention is built.  MarianAttention: q_proj/k_proj/v_proj/out_proj
with bias, q_proj(h) * scaling, (b, h, s, d) matmul, legacy tuple cache (k, v) concatenated on dim 2,
additive causal mask (finfo.min) with the past columns visible.
Cache: hf tuples: `out = model(ids, use_cache=True)`, then `model(tok, past_key_values=out.past_key_values,
use_cache=True)`; logits in `out.logits`.
Slip: in the branch that extends an existing cache the value line was pasted from the key line:
`value_states = torch.cat([past_key_value[1], key_states], dim=2)`, so the new token's value slot holds
its key.  The cache length and positions are right; the prompt pass is exact.
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
        "mistake": "cache_other",
        "step": 0,
        "layer": "model.decoder.layers.0.self_attn",
    },
    "style": "modeling_marian.py MarianForCausalLM: embed_scale, sin|cos sinusoidal positions without offset, post-norm, "
    "swish FFN, final_logits_bias, legacy (k, v) tuples; slip: cached values extended with the new keys",
}


class MarianSinusoidalPositionalEmbedding(nn.Module):
    def __init__(self, num_positions, embedding_dim):
        super().__init__()
        position_enc = torch.tensor(
            [[pos / math.pow(10000, 2 * (j // 2) / embedding_dim) for j in range(embedding_dim)]
             for pos in range(num_positions)], dtype=torch.float64)
        sentinel = embedding_dim // 2 if embedding_dim % 2 == 0 else (embedding_dim // 2) + 1
        out = torch.empty(num_positions, embedding_dim, dtype=torch.float64)
        out[:, 0:sentinel] = torch.sin(position_enc[:, 0::2])
        out[:, sentinel:] = torch.cos(position_enc[:, 1::2])
        self.table = out  # float64, not a parameter

    def forward(self, input_ids_shape, past_key_values_length=0, dtype=torch.float32):
        seq_len = input_ids_shape[1]
        return self.table[past_key_values_length : past_key_values_length + seq_len].to(dtype)


class MarianAttention(nn.Module):
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
        query_states = self._shape(self.q_proj(hidden_states) * self.scaling, tgt_len, bsz)
        key_states = self._shape(self.k_proj(hidden_states), -1, bsz)
        value_states = self._shape(self.v_proj(hidden_states), -1, bsz)
        if past_key_value is not None:
            key_states = torch.cat([past_key_value[0], key_states], dim=2)
            value_states = torch.cat([past_key_value[1], key_states[:, :, -tgt_len:]], dim=2)
        past_key_value = (key_states, value_states)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3))
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).reshape(bsz, tgt_len, self.embed_dim)
        return self.out_proj(attn_output), past_key_value


class MarianDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_dim = config.d_model
        self.self_attn = MarianAttention(config.d_model, config.decoder_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(self.embed_dim)
        self.fc1 = nn.Linear(self.embed_dim, config.decoder_ffn_dim)
        self.fc2 = nn.Linear(config.decoder_ffn_dim, self.embed_dim)
        self.final_layer_norm = nn.LayerNorm(self.embed_dim)

    def forward(self, hidden_states, attention_mask=None, past_key_value=None):
        residual = hidden_states
        hidden_states, present = self.self_attn(hidden_states, past_key_value, attention_mask)
        hidden_states = self.self_attn_layer_norm(residual + hidden_states)
        residual = hidden_states
        hidden_states = self.fc2(F.silu(self.fc1(hidden_states)))
        hidden_states = self.final_layer_norm(residual + hidden_states)
        return hidden_states, present


class MarianDecoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_scale = math.sqrt(config.d_model) if config.scale_embedding else 1.0
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.embed_positions = MarianSinusoidalPositionalEmbedding(config.max_position_embeddings, config.d_model)
        self.layers = nn.ModuleList(MarianDecoderLayer(config) for _ in range(config.decoder_layers))

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        bsz, tgt_len = input_ids.shape
        past_len = past_key_values[0][0].shape[2] if past_key_values is not None else 0
        inputs_embeds = self.embed_tokens(input_ids) * self.embed_scale
        dtype = inputs_embeds.dtype
        mask = torch.full((tgt_len, tgt_len), torch.finfo(dtype).min, dtype=dtype).triu(1)
        mask = torch.cat([torch.zeros(tgt_len, past_len, dtype=dtype), mask], dim=-1)[None, None]
        hidden_states = inputs_embeds + self.embed_positions(input_ids.shape, past_len, dtype)
        next_cache = ()
        for idx, layer in enumerate(self.layers):
            past = past_key_values[idx] if past_key_values is not None else None
            hidden_states, present = layer(hidden_states, mask, past)
            next_cache += (present,)
        return hidden_states, (next_cache if use_cache else None)


class MarianDecoderWrapper(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.decoder = MarianDecoder(config)


class MarianForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = MarianDecoderWrapper(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.register_buffer("final_logits_bias", torch.zeros(1, config.vocab_size))

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        hidden, cache = self.model.decoder(input_ids, past_key_values, use_cache)
        return SimpleNamespace(logits=self.lm_head(hidden) + self.final_logits_bias, past_key_values=cache)


def make_model():
    torch.manual_seed(1413)
    config = SimpleNamespace(vocab_size=96, d_model=64, decoder_layers=3, decoder_attention_heads=4,
                             decoder_ffn_dim=128, max_position_embeddings=64, scale_embedding=True)
    model = MarianForCausalLM(config)
    g = torch.Generator().manual_seed(14131)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
        model.model.decoder.embed_tokens.weight.mul_(0.125)
        model.final_logits_bias.normal_(0.0, 0.1, generator=g)
    return model.eval()

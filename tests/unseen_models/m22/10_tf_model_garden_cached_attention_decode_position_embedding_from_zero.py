"""tensorflow/models (TF Model Garden, official/nlp/modeling) decoder-only LM ported to PyTorch:
layers.PositionEmbedding, layers.TransformerDecoderBlock (self-attention only) and layers.CachedAttention.

Kept: `embedding_layer` (word embeddings), `position_embedding` (learned table, PositionEmbedding reads
rows [:seq_length]), `embedding_norm_layer`, `decoder_layers.N` with `self_attention` (CachedAttention
on Keras MultiHeadAttention: EinsumDense `_query_dense`/`_key_dense`/`_value_dense` kernels
(hidden, heads, key_dim) + bias, `_output_dense` kernel (heads, key_dim, hidden) + bias),
`self_attention_layer_norm`, `intermediate_dense`, `output_dense`, `output_layer_norm` (post-norm, the
block's default norm_first=False).  MultiHeadAttention multiplies the query by 1/sqrt(key_dim), einsum
"aecd,abcd->acbe", MaskedSoftmax adds (1 - mask) * -1e9, softmax, einsum back.  CachedAttention's
`_update_cache` concatenates the new key/value onto cache["key"]/cache["value"] along the sequence axis
(layout (b, s, heads, key_dim)).
Cache: hf: `out = model(ids, use_cache=True)`, then `model(tok, past_key_values=out.past_key_values,
use_cache=True)`; `past_key_values` is the Model Garden list of per-layer {"key", "value"} dicts.
Slip: the LM adds `position_embedding(word_embeddings)` for every call; PositionEmbedding slices
rows [:seq_length] of its table, so during decoding (one token per call) every new token is embedded
at position 0 instead of at the cache length.  The causal mask is built from the real lengths.
The full forward and the prompt pass are exact.
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
        "decoder_layers.0.self_attention",
        "decoder_layers.1.self_attention",
        "decoder_layers.2.self_attention",
    ],
    "kind": "causal-multihead",
    "cache": "hf",
    "decode": {
        "mistake": "cache_positions",
        "step": 0,
        "layer": "decoder_layers.0.self_attention",
    },
    "style": "TF Model Garden TransformerDecoderBlock + CachedAttention ported: EinsumDense (hidden, heads, key_dim) "
    "kernels, post-norm, MaskedSoftmax -1e9, cache dicts {'key','value'} (b, s, h, d) concatenated on axis 1; "
    "PositionEmbedding slices rows [:seq_length] on every call, so decoded tokens sit at position 0",
}


class EinsumDense(nn.Module):
    def __init__(self, equation, kernel_shape, bias_shape):
        super().__init__()
        self.equation = equation
        fan_in = kernel_shape[0] if equation.startswith("abc,") else kernel_shape[0] * kernel_shape[1]
        self.kernel = nn.Parameter(torch.randn(*kernel_shape) / math.sqrt(fan_in))
        self.bias = nn.Parameter(0.02 * torch.randn(*bias_shape))

    def forward(self, x):
        return torch.einsum(self.equation, x, self.kernel) + self.bias


class CachedAttention(nn.Module):
    def __init__(self, num_heads, key_dim, hidden):
        super().__init__()
        self._num_heads = num_heads
        self._key_dim = key_dim
        self._query_dense = EinsumDense("abc,cde->abde", (hidden, num_heads, key_dim), (num_heads, key_dim))
        self._key_dense = EinsumDense("abc,cde->abde", (hidden, num_heads, key_dim), (num_heads, key_dim))
        self._value_dense = EinsumDense("abc,cde->abde", (hidden, num_heads, key_dim), (num_heads, key_dim))
        self._output_dense = EinsumDense("abcd,cde->abe", (num_heads, key_dim, hidden), (hidden,))

    def _update_cache(self, key, value, cache):
        if cache is not None and cache.get("key") is not None:
            key = torch.cat([cache["key"], key], dim=1)
            value = torch.cat([cache["value"], value], dim=1)
        if cache is not None:
            cache["key"] = key
            cache["value"] = value
        return key, value

    def forward(self, query, value, attention_mask=None, cache=None):
        query = self._query_dense(query)
        key = self._key_dense(value)
        value = self._value_dense(value)
        key, value = self._update_cache(key, value, cache)
        query = query * (1.0 / math.sqrt(float(self._key_dim)))
        attention_scores = torch.einsum("aecd,abcd->acbe", key, query)
        # MaskedSoftmax
        adder = (1.0 - attention_mask.to(attention_scores.dtype)) * -1e9
        attention_scores = attention_scores + adder[:, None]
        attention_scores = F.softmax(attention_scores, dim=-1)
        attention_output = torch.einsum("acbe,aecd->abcd", attention_scores, value)
        return self._output_dense(attention_output), cache


class TransformerDecoderBlock(nn.Module):
    def __init__(self, num_attention_heads, intermediate_size, hidden):
        super().__init__()
        self.self_attention = CachedAttention(num_attention_heads, hidden // num_attention_heads, hidden)
        self.self_attention_layer_norm = nn.LayerNorm(hidden, eps=1e-12)
        self.intermediate_dense = nn.Linear(hidden, intermediate_size)
        self.output_dense = nn.Linear(intermediate_size, hidden)
        self.output_layer_norm = nn.LayerNorm(hidden, eps=1e-12)

    def forward(self, input_tensor, self_attention_mask, cache=None):
        self_attention_output, cache = self.self_attention(
            query=input_tensor, value=input_tensor, attention_mask=self_attention_mask, cache=cache
        )
        self_attention_output = self.self_attention_layer_norm(input_tensor + self_attention_output)
        intermediate_output = F.relu(self.intermediate_dense(self_attention_output))
        layer_output = self.output_dense(intermediate_output)
        return self.output_layer_norm(layer_output + self_attention_output), cache


class PositionEmbedding(nn.Module):
    def __init__(self, max_length, width):
        super().__init__()
        self.embeddings = nn.Parameter(torch.randn(max_length, width))

    def forward(self, inputs):
        seq_length = inputs.shape[1]
        return self.embeddings[:seq_length][None]


class GardenDecoderLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embedding_layer = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embedding = PositionEmbedding(config.max_sequence_length, config.hidden_size)
        self.embedding_norm_layer = nn.LayerNorm(config.hidden_size, eps=1e-12)
        self.decoder_layers = nn.ModuleList(
            [
                TransformerDecoderBlock(config.num_attention_heads, config.intermediate_size, config.hidden_size)
                for _ in range(config.num_layers)
            ]
        )
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        b, s = input_ids.shape
        past_len = past_key_values[0]["key"].shape[1] if past_key_values is not None else 0
        word_embeddings = self.embedding_layer(input_ids)
        embeddings = word_embeddings + self.position_embedding(word_embeddings)
        x = self.embedding_norm_layer(embeddings)
        total = past_len + s
        q_pos = torch.arange(past_len, total, device=input_ids.device)
        k_pos = torch.arange(total, device=input_ids.device)
        self_attention_mask = (k_pos[None, :] <= q_pos[:, None])[None].expand(b, s, total)
        if use_cache and past_key_values is None:
            past_key_values = [{"key": None, "value": None} for _ in self.decoder_layers]
        for i, layer in enumerate(self.decoder_layers):
            x, _ = layer(x, self_attention_mask, past_key_values[i] if use_cache else None)
        return SimpleNamespace(logits=self.lm_head(x), past_key_values=past_key_values if use_cache else None)


def make_model():
    torch.manual_seed(2210)
    config = SimpleNamespace(
        vocab_size=96, hidden_size=64, num_attention_heads=4, intermediate_size=192, num_layers=3,
        max_sequence_length=64,
    )
    model = GardenDecoderLM(config)
    g = torch.Generator().manual_seed(22101)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model.eval()

"""keras-hub MistralCausalLM ported to PyTorch layer by layer, with its stacked decoding cache.

MistralCausalLM: backbone (MistralBackbone: token_embedding, transformer_layers.N, layer_norm), then a
separate output projection (`lm_head`, tie_word_embeddings False).  Each MistralTransformerDecoder keeps
keras-hub's attribute names: _self_attention_layernorm, _self_attention_layer, _feedforward_layernorm,
_feedforward_intermediate_dense / _feedforward_gate_dense / _feedforward_output_dense (SiLU gate).
CachedMistralAttention: EinsumDense kernels in keras layout (_query_dense "bqm,muh->bquh" with kernel
(hidden, heads, head_dim), _key_dense / _value_dense with kv_heads, _output_dense "bquh,uhm->bqm"),
keras-hub RotaryEmbedding (split in halves, stack(-x2, x1)) with max_wavelength 1e4 and start_index =
cache_update_index, GQA 4/2 through ops.repeat on the head axis (repeat_interleave), query multiplied by
1/sqrt(head_dim) before "bquh,bkuh->buqk", keras Softmax with a 0/1 mask (masked logits get -1e9).
Sliding window 4 on every layer (`sliding_window` in the config): the decoder's mask keeps
j <= i and i < j + sliding_window, with i offset by cache_update_index.
Cache: one stacked tensor (batch, num_layers, 2, max_length, kv_heads, head_dim) written with
slice_update at cache_update_index; here it lives in `KVCache` (book-cache convention):
`cache = mod.KVCache(n_layers=3)`, `model(prompt, cache=cache)`, `model(tok, cache=cache)`.
`model(ids)` is the plain forward.  Returns the logits tensor.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": [
        "backbone.transformer_layers.0._self_attention_layer",
        "backbone.transformer_layers.1._self_attention_layer",
        "backbone.transformer_layers.2._self_attention_layer",
    ],
    "kind": "causal-multihead",
    "cache": "book-cache",
    "style": "keras-hub MistralCausalLM port: EinsumDense (hidden, heads, hd) kernels, keras-hub RotaryEmbedding (halves) "
    "with start_index, GQA 4/2 by ops.repeat, sliding window 4 on every layer, keras Softmax with 0/1 mask, "
    "stacked (b, layers, 2, max_len, kv, hd) cache updated at cache_update_index",
}


class KVCache:
    """Holds keras-hub's stacked cache tensor and the running cache_update_index."""

    def __init__(self, n_layers, max_length=64):
        self.n_layers = n_layers
        self.max_length = max_length
        self.cache = None
        self.index = 0

    def reset(self):
        self.cache = None
        self.index = 0


class EinsumDense(nn.Module):
    def __init__(self, equation, kernel_shape):
        super().__init__()
        self.equation = equation
        fan_in = kernel_shape[0] if equation.startswith("bqm") else kernel_shape[0] * kernel_shape[1]
        self.kernel = nn.Parameter(torch.randn(*kernel_shape) / math.sqrt(fan_in))

    def forward(self, x):
        return torch.einsum(self.equation, x, self.kernel)


class MistralLayerNormalization(nn.Module):
    def __init__(self, dim, epsilon=1e-6):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))
        self.epsilon = epsilon

    def forward(self, x):
        var = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(var + self.epsilon) * self.scale


class RotaryEmbedding(nn.Module):
    def __init__(self, max_wavelength=10000.0):
        super().__init__()
        self.max_wavelength = max_wavelength

    def forward(self, inputs, start_index=0):
        # inputs: (batch, seq, heads, dim); sequence_axis 1, feature_axis -1
        dim = inputs.shape[-1]
        seq_len = inputs.shape[1]
        inverse_freq = 1.0 / (
            self.max_wavelength ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        )
        positions = torch.arange(seq_len, dtype=torch.float64) + start_index
        freq = torch.einsum("i,j->ij", positions, inverse_freq)
        embedding = torch.stack((freq, freq), dim=-2).reshape(seq_len, dim)
        cos_emb = embedding.cos()[None, :, None, :].to(inputs.dtype)
        sin_emb = embedding.sin()[None, :, None, :].to(inputs.dtype)
        x1, x2 = torch.split(inputs, dim // 2, dim=-1)
        half_rot = torch.stack((-x2, x1), dim=-2).reshape(inputs.shape)
        return inputs * cos_emb + half_rot * sin_emb


class CachedMistralAttention(nn.Module):
    def __init__(self, hidden_dim, num_query_heads, num_key_value_heads, rope_max_wavelength):
        super().__init__()
        self._num_query_heads = num_query_heads
        self._num_key_value_heads = num_key_value_heads
        self._num_key_value_groups = num_query_heads // num_key_value_heads
        self._head_dim = hidden_dim // num_query_heads
        self._inv_norm_factor = 1.0 / math.sqrt(self._head_dim)
        self._query_dense = EinsumDense("bqm,muh->bquh", (hidden_dim, num_query_heads, self._head_dim))
        self._key_dense = EinsumDense("bkm,mvh->bkvh", (hidden_dim, num_key_value_heads, self._head_dim))
        self._value_dense = EinsumDense("bkm,mvh->bkvh", (hidden_dim, num_key_value_heads, self._head_dim))
        self._output_dense = EinsumDense("bquh,uhm->bqm", (num_query_heads, self._head_dim, hidden_dim))
        self.rotary_embedding_layer = RotaryEmbedding(rope_max_wavelength)

    def forward(self, hidden_states, attention_mask, cache=None, cache_update_index=None):
        start_index = 0 if cache_update_index is None else cache_update_index
        query = self._query_dense(hidden_states)
        query = self.rotary_embedding_layer(query, start_index=start_index)
        if cache is not None:
            key_cache = cache[:, 0, ...]
            value_cache = cache[:, 1, ...]
            key_update = self.rotary_embedding_layer(self._key_dense(hidden_states), start_index=start_index)
            value_update = self._value_dense(hidden_states)
            t = hidden_states.shape[1]
            key = key_cache.clone()
            value = value_cache.clone()
            key[:, start_index : start_index + t] = key_update
            value[:, start_index : start_index + t] = value_update
            cache = torch.stack((key, value), dim=1)
        else:
            key = self.rotary_embedding_layer(self._key_dense(hidden_states), start_index=start_index)
            value = self._value_dense(hidden_states)
        key = torch.repeat_interleave(key, self._num_key_value_groups, dim=2)
        value = torch.repeat_interleave(value, self._num_key_value_groups, dim=2)
        query = query * self._inv_norm_factor
        attention_scores = torch.einsum("bquh,bkuh->buqk", query, key)
        # keras Softmax(axis=-1) with a mask: adds (1 - mask) * -1e9 before the softmax
        adder = (1.0 - attention_mask[:, None, :, :].to(attention_scores.dtype)) * -1e9
        attention_scores = torch.softmax(attention_scores + adder, dim=-1)
        attention_output = torch.einsum("buqk,bkuh->bquh", attention_scores, value)
        attention_output = self._output_dense(attention_output)
        if cache is not None:
            return attention_output, cache
        return attention_output


class MistralTransformerDecoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.sliding_window = config.sliding_window
        self._self_attention_layernorm = MistralLayerNormalization(config.hidden_dim, config.layer_norm_epsilon)
        self._self_attention_layer = CachedMistralAttention(
            config.hidden_dim, config.num_query_heads, config.num_key_value_heads, config.rope_max_wavelength
        )
        self._feedforward_layernorm = MistralLayerNormalization(config.hidden_dim, config.layer_norm_epsilon)
        self._feedforward_intermediate_dense = nn.Linear(config.hidden_dim, config.intermediate_dim, bias=False)
        self._feedforward_gate_dense = nn.Linear(config.hidden_dim, config.intermediate_dim, bias=False)
        self._feedforward_output_dense = nn.Linear(config.intermediate_dim, config.hidden_dim, bias=False)

    def _compute_self_attention_mask(self, batch_size, input_length, output_length, cache_update_index):
        i = torch.arange(output_length)[:, None] + cache_update_index
        j = torch.arange(input_length)[None, :]
        causal_mask = (i >= j).to(torch.int32)
        if self.sliding_window is not None:
            causal_mask_upper = (i < j + self.sliding_window).to(torch.int32)
            causal_mask = torch.minimum(causal_mask, causal_mask_upper)
        return causal_mask[None].expand(batch_size, -1, -1)

    def forward(self, decoder_sequence, self_attention_cache=None, self_attention_cache_update_index=None):
        batch_size, output_length = decoder_sequence.shape[:2]
        index = 0 if self_attention_cache_update_index is None else self_attention_cache_update_index
        input_length = output_length if self_attention_cache is None else self_attention_cache.shape[2]
        mask = self._compute_self_attention_mask(batch_size, input_length, output_length, index)
        mask = mask.to(decoder_sequence.device)
        residual = decoder_sequence
        x = self._self_attention_layernorm(decoder_sequence)
        if self_attention_cache is not None:
            x, self_attention_cache = self._self_attention_layer(
                x, attention_mask=mask, cache=self_attention_cache, cache_update_index=index
            )
        else:
            x = self._self_attention_layer(x, attention_mask=mask)
        x = x + residual
        residual = x
        x = self._feedforward_layernorm(x)
        gate = F.silu(self._feedforward_gate_dense(x))
        x = self._feedforward_output_dense(self._feedforward_intermediate_dense(x) * gate)
        x = x + residual
        if self_attention_cache is not None:
            return x, self_attention_cache
        return x


class MistralBackbone(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.token_embedding = nn.Embedding(config.vocabulary_size, config.hidden_dim)
        self.transformer_layers = nn.ModuleList(
            [MistralTransformerDecoder(config) for _ in range(config.num_layers)]
        )
        self.layer_norm = MistralLayerNormalization(config.hidden_dim, config.layer_norm_epsilon)

    def forward(self, token_ids):
        x = self.token_embedding(token_ids)
        for layer in self.transformer_layers:
            x = layer(x)
        return self.layer_norm(x)


class MistralCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.backbone = MistralBackbone(config)
        self.lm_head = nn.Linear(config.hidden_dim, config.vocabulary_size, bias=False)

    def call_with_cache(self, token_ids, cache, cache_update_index):
        x = self.backbone.token_embedding(token_ids)
        updated_cache = []
        for i, layer in enumerate(self.backbone.transformer_layers):
            current_cache = cache[:, i, ...]
            x, next_cache = layer(
                x, self_attention_cache=current_cache, self_attention_cache_update_index=cache_update_index
            )
            updated_cache.append(next_cache)
        cache = torch.stack(updated_cache, dim=1)
        hidden_states = x = self.backbone.layer_norm(x)
        return self.lm_head(x), hidden_states, cache

    def reset_kv_cache(self):
        pass

    def forward(self, token_ids, cache=None):
        if cache is None:
            return self.lm_head(self.backbone(token_ids))
        if cache.cache is None:
            c = self.config
            hd = c.hidden_dim // c.num_query_heads
            cache.cache = torch.zeros(
                token_ids.shape[0], c.num_layers, 2, cache.max_length, c.num_key_value_heads, hd,
                dtype=self.backbone.token_embedding.weight.dtype, device=token_ids.device,
            )
        logits, _, cache.cache = self.call_with_cache(token_ids, cache.cache, cache.index)
        cache.index += token_ids.shape[1]
        return logits


def make_model():
    torch.manual_seed(1602)
    config = SimpleNamespace(
        vocabulary_size=96,
        num_layers=3,
        num_query_heads=4,
        num_key_value_heads=2,
        hidden_dim=64,
        intermediate_dim=128,
        rope_max_wavelength=10000.0,
        layer_norm_epsilon=1e-6,
        sliding_window=4,
    )
    model = MistralCausalLM(config)
    g = torch.Generator().manual_seed(16021)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, MistralLayerNormalization):
                m.scale.copy_(1.0 + 0.3 * torch.randn(m.scale.shape, generator=g))
    return model.eval()

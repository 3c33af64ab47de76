"""KerasHub GPT2Backbone / TransformerDecoder / CachedMultiHeadAttention, ported to torch.

Keras naming kept: token_embedding, position_embedding, transformer_layer_{i} attributes holding
_self_attention_layer_norm, _self_attention_layer, _feedforward_layer_norm,
_feedforward_intermediate_dense, _feedforward_output_dense; final layer_norm; reversed token
embedding as the head.  The attention is Keras MultiHeadAttention with EinsumDense kernels:
_query_dense/_key_dense/_value_dense kernel (d, H, hd) + bias (H, hd), _output_dense kernel
(H, hd, d) + bias (d); query * 1/sqrt(hd) before einsum("aecd,abcd->acbe"), masked softmax adding
(1 - mask) * -1e9.  Slip: transformer_layer_2 is built with a CachedMultiHeadAttention subclass
whose _compute_attention override returns the merged heads and the call skips _output_dense
(the kernel exists and is initialised).  No cache.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": [
        "transformer_layer_0._self_attention_layer",
        "transformer_layer_1._self_attention_layer",
        "transformer_layer_2._self_attention_layer",
    ],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "transformer_layer_2._self_attention_layer",
    "stage": "output",
    "mistake": "missing_out_proj",
    "style": "KerasHub GPT2Backbone port: transformer_layer_{i} attributes, underscore Keras names, EinsumDense kernels "
    "(d,H,hd)/(H,hd,d) with einsum, query*1/sqrt(hd), masked softmax (1-mask)*-1e9; slip: layer 2 never applies _output_dense",
}


class EinsumDense(nn.Module):
    def __init__(self, equation, kernel_shape, bias_shape):
        super().__init__()
        self.equation = equation
        self.kernel = nn.Parameter(torch.randn(*kernel_shape) * 0.1)
        self.bias = nn.Parameter(torch.randn(*bias_shape) * 0.05)

    def forward(self, x):
        return torch.einsum(self.equation, x, self.kernel) + self.bias


class MaskedSoftmax(nn.Module):
    def forward(self, inputs, mask=None):
        if mask is not None:
            adder = (1.0 - mask.to(inputs.dtype)) * -1e9
            inputs = inputs + adder
        return torch.softmax(inputs, dim=-1)


class CachedMultiHeadAttention(nn.Module):
    def __init__(self, num_heads, key_dim, hidden_dim):
        super().__init__()
        self._num_heads = num_heads
        self._key_dim = key_dim
        self._inverse_sqrt_key_dim = 1.0 / math.sqrt(float(key_dim))
        self._query_dense = EinsumDense(
            "abc,cde->abde", (hidden_dim, num_heads, key_dim), (num_heads, key_dim)
        )
        self._key_dense = EinsumDense(
            "abc,cde->abde", (hidden_dim, num_heads, key_dim), (num_heads, key_dim)
        )
        self._value_dense = EinsumDense(
            "abc,cde->abde", (hidden_dim, num_heads, key_dim), (num_heads, key_dim)
        )
        self._output_dense = EinsumDense(
            "abcd,cde->abe", (num_heads, key_dim, hidden_dim), (hidden_dim,)
        )
        self._softmax = MaskedSoftmax()

    def _compute_attention(self, query, key, value, attention_mask=None):
        query = query * self._inverse_sqrt_key_dim
        attention_scores = torch.einsum("aecd,abcd->acbe", key, query)
        attention_scores = self._softmax(
            attention_scores, attention_mask[:, None] if attention_mask is not None else None
        )
        attention_output = torch.einsum("acbe,aecd->abcd", attention_scores, value)
        return attention_output, attention_scores

    def forward(self, query, value, key=None, attention_mask=None):
        if key is None:
            key = value
        query = self._query_dense(query)
        key = self._key_dense(key)
        value = self._value_dense(value)
        attention_output, _ = self._compute_attention(query, key, value, attention_mask)
        return self._output_dense(attention_output)


class MergedHeadsCachedMultiHeadAttention(CachedMultiHeadAttention):
    """Variant used by a ported decoding layer: returns (b, s, H*hd) straight from _compute_attention."""

    def _compute_attention(self, query, key, value, attention_mask=None):
        out, scores = super()._compute_attention(query, key, value, attention_mask)
        return out.reshape(out.shape[0], out.shape[1], -1), scores

    def forward(self, query, value, key=None, attention_mask=None):
        if key is None:
            key = value
        query = self._query_dense(query)
        key = self._key_dense(key)
        value = self._value_dense(value)
        attention_output, _ = self._compute_attention(query, key, value, attention_mask)
        return attention_output


def compute_causal_mask(batch_size, input_length, output_length, cache_index=0, device=None):
    i = torch.arange(output_length, device=device)[:, None] + cache_index
    j = torch.arange(input_length, device=device)[None, :]
    mask = (i >= j).int()
    return mask[None].expand(batch_size, -1, -1)


class TransformerDecoder(nn.Module):
    def __init__(
        self,
        intermediate_dim,
        num_heads,
        hidden_dim,
        layer_norm_epsilon=1e-5,
        attention_cls=CachedMultiHeadAttention,
    ):
        super().__init__()
        self._self_attention_layer_norm = nn.LayerNorm(hidden_dim, eps=layer_norm_epsilon)
        self._self_attention_layer = attention_cls(num_heads, hidden_dim // num_heads, hidden_dim)
        self._feedforward_layer_norm = nn.LayerNorm(hidden_dim, eps=layer_norm_epsilon)
        self._feedforward_intermediate_dense = nn.Linear(hidden_dim, intermediate_dim)
        self._feedforward_output_dense = nn.Linear(intermediate_dim, hidden_dim)

    def forward(self, decoder_sequence):
        b, s, _ = decoder_sequence.shape
        self_attention_mask = compute_causal_mask(b, s, s, device=decoder_sequence.device)
        residual = decoder_sequence
        x = self._self_attention_layer_norm(decoder_sequence)
        x = self._self_attention_layer(query=x, value=x, attention_mask=self_attention_mask)
        x = x + residual
        residual = x
        x = self._feedforward_layer_norm(x)
        x = self._feedforward_output_dense(
            F.gelu(self._feedforward_intermediate_dense(x), approximate="tanh")
        )
        return x + residual


class GPT2Backbone(nn.Module):
    def __init__(
        self,
        vocabulary_size=115,
        num_layers=3,
        num_heads=4,
        hidden_dim=64,
        intermediate_dim=256,
        max_sequence_length=64,
        ported_layers=(2,),
    ):
        super().__init__()
        self.num_layers = num_layers
        self.token_embedding = nn.Embedding(vocabulary_size, hidden_dim)
        self.position_embedding = nn.Embedding(max_sequence_length, hidden_dim)
        for i in range(num_layers):
            cls = (
                MergedHeadsCachedMultiHeadAttention
                if i in ported_layers
                else CachedMultiHeadAttention
            )
            setattr(
                self,
                f"transformer_layer_{i}",
                TransformerDecoder(intermediate_dim, num_heads, hidden_dim, attention_cls=cls),
            )
        self.layer_norm = nn.LayerNorm(hidden_dim, eps=1e-5)

    def forward(self, token_ids):
        positions = torch.arange(token_ids.shape[1], device=token_ids.device)
        x = self.token_embedding(token_ids) + self.position_embedding(positions)[None]
        for i in range(self.num_layers):
            x = getattr(self, f"transformer_layer_{i}")(x)
        x = self.layer_norm(x)
        return x @ self.token_embedding.weight.T


def make_model():
    torch.manual_seed(709)
    model = GPT2Backbone()
    with torch.no_grad():
        model.token_embedding.weight.normal_(0.0, 0.5)
        model.position_embedding.weight.normal_(0.0, 0.3)
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn_like(m.weight))
                m.bias.copy_(0.1 * torch.randn_like(m.bias))
    return model.eval()

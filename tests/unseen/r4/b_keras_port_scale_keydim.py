"""Keras MultiHeadAttention ported to PyTorch (EinsumDense parameters); bug: the queries are scaled by 1/key_dim instead of 1/sqrt(key_dim)."""

import torch
import torch.nn as nn


class EinsumDense(nn.Module):
    """Port of keras.layers.EinsumDense for the two equations attention needs."""

    def __init__(self, equation, kernel_shape, bias_shape=None):
        super().__init__()
        self.equation = equation
        self.kernel = nn.Parameter(torch.empty(*kernel_shape))
        nn.init.xavier_uniform_(self.kernel.view(kernel_shape[0], -1))
        self.bias = nn.Parameter(torch.zeros(*bias_shape)) if bias_shape is not None else None

    def forward(self, inputs):
        out = torch.einsum(self.equation, inputs, self.kernel)
        if self.bias is not None:
            out = out + self.bias
        return out


class MultiHeadAttention(nn.Module):
    def __init__(self, num_heads, key_dim, input_dim, dropout=0.0, use_bias=True):
        super().__init__()
        self._num_heads = num_heads
        self._key_dim = key_dim
        self._dropout = dropout
        bias = (num_heads, key_dim) if use_bias else None
        self._query_dense = EinsumDense("abc,cde->abde", (input_dim, num_heads, key_dim), bias)
        self._key_dense = EinsumDense("abc,cde->abde", (input_dim, num_heads, key_dim), bias)
        self._value_dense = EinsumDense("abc,cde->abde", (input_dim, num_heads, key_dim), bias)
        self._output_dense = EinsumDense(
            "abcd,cde->abe", (num_heads, key_dim, input_dim), (input_dim,) if use_bias else None
        )
        self._dropout_layer = nn.Dropout(dropout)
        self._dot_product_equation = "aecd,abcd->acbe"
        self._combine_equation = "acbe,aecd->abcd"

    def _compute_attention(self, query, key, value, attention_mask=None):
        query = query * (1.0 / float(self._key_dim))
        # (B, S, N, H) x (B, T, N, H) -> (B, N, T, S)
        attention_scores = torch.einsum(self._dot_product_equation, key, query)
        if attention_mask is not None:
            attention_scores = attention_scores.masked_fill(~attention_mask, -1e9)
        attention_scores = torch.softmax(attention_scores, dim=-1)
        scores_dropout = self._dropout_layer(attention_scores)
        attention_output = torch.einsum(self._combine_equation, scores_dropout, value)
        return attention_output, attention_scores

    def forward(
        self, query, value=None, key=None, attention_mask=None, return_attention_scores=False
    ):
        if value is None:
            value = query
        if key is None:
            key = value
        query = self._query_dense(query)  # (B, T, N, H)
        key = self._key_dense(key)
        value = self._value_dense(value)
        attention_output, attention_scores = self._compute_attention(
            query, key, value, attention_mask
        )
        attention_output = self._output_dense(attention_output)
        if return_attention_scores:
            return attention_output, attention_scores
        return attention_output


def make_keras_mha():
    return MultiHeadAttention(num_heads=4, key_dim=6, input_dim=24)


EXPECT = {
    "target": "make_keras_mha",
    "kind": "multihead",
    "ok": False,
    "stage": "scaled_scores",
    "mistake": "wrong_scale",
    "style": "Keras MultiHeadAttention port (EinsumDense parameters, einsum scores)",
}

"""CTRL-style EncoderLayer: MultiHeadAttention(Wq, Wk, Wv, dense) with forward(v, k, q, mask), mask * -1e4 from a triu."""

import math

import torch
from torch import nn


def scaled_dot_product_attention(q, k, v, mask, attention_mask=None, head_mask=None):
    matmul_qk = torch.matmul(q, k.permute(0, 1, 3, 2))
    dk = k.shape[-1]
    scaled_attention_logits = matmul_qk / math.sqrt(dk)

    if mask is not None:
        nd, ns = scaled_attention_logits.size(-2), scaled_attention_logits.size(-1)
        scaled_attention_logits += mask[ns - nd : ns, :ns] * -1e4
    if attention_mask is not None:
        scaled_attention_logits = scaled_attention_logits + attention_mask

    attention_weights = torch.softmax(scaled_attention_logits, dim=-1)
    if head_mask is not None:
        attention_weights = attention_weights * head_mask
    output = torch.matmul(attention_weights, v)
    return output, attention_weights


class MultiHeadAttention(nn.Module):
    def __init__(self, d_model_size, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.d_model_size = d_model_size
        self.depth = int(d_model_size / self.num_heads)

        self.Wq = nn.Linear(d_model_size, d_model_size)
        self.Wk = nn.Linear(d_model_size, d_model_size)
        self.Wv = nn.Linear(d_model_size, d_model_size)
        self.dense = nn.Linear(d_model_size, d_model_size)

    def split_into_heads(self, x, batch_size):
        x = x.reshape(batch_size, -1, self.num_heads, self.depth)
        return x.permute([0, 2, 1, 3])

    def forward(self, v, k, q, mask, attention_mask=None, head_mask=None, output_attentions=False):
        batch_size = q.shape[0]
        q = self.split_into_heads(self.Wq(q), batch_size)
        k = self.split_into_heads(self.Wk(k), batch_size)
        v = self.split_into_heads(self.Wv(v), batch_size)

        output = scaled_dot_product_attention(q, k, v, mask, attention_mask, head_mask)
        scaled_attention = output[0].permute([0, 2, 1, 3])
        original_size_attention = scaled_attention.reshape(batch_size, -1, self.d_model_size)
        output = self.dense(original_size_attention)

        outputs = (output,)
        if output_attentions:
            outputs = outputs + (output[1],)
        return outputs


def point_wise_feed_forward_network(d_model_size, dff):
    return nn.Sequential(nn.Linear(d_model_size, dff), nn.ReLU(), nn.Linear(dff, d_model_size))


class EncoderLayer(nn.Module):
    def __init__(self, d_model_size, num_heads, dff, rate=0.1):
        super().__init__()
        self.multi_head_attention = MultiHeadAttention(d_model_size, num_heads)
        self.ffn = point_wise_feed_forward_network(d_model_size, dff)
        self.layernorm1 = nn.LayerNorm(d_model_size, eps=1e-6)
        self.layernorm2 = nn.LayerNorm(d_model_size, eps=1e-6)
        self.dropout1 = nn.Dropout(rate)
        self.dropout2 = nn.Dropout(rate)

    def forward(self, x, mask=None, attention_mask=None):
        if mask is None:
            _, seq_len, _ = x.shape
            mask = torch.triu(torch.ones(seq_len, seq_len, dtype=x.dtype, device=x.device), 1)
        normed = self.layernorm1(x)
        attn_outputs = self.multi_head_attention(
            normed, normed, normed, mask, attention_mask=attention_mask
        )
        out1 = x + self.dropout1(attn_outputs[0])
        out2 = out1 + self.dropout2(self.ffn(self.layernorm2(out1)))
        return (out2,) + attn_outputs[1:]


def make_layer():
    return EncoderLayer(d_model_size=20, num_heads=4, dff=40, rate=0.0)


EXPECT = {
    "target": "make_layer",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "multi_head_attention",
    "style": "CTRL EncoderLayer / MultiHeadAttention (Wq/Wk/Wv/dense, forward(v, k, q, mask), mask * -1e4)",
}

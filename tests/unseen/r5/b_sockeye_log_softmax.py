"""Sockeye-style time-major MultiHeadSelfAttention (ff_in -> q,k,v, DotAttentionCell, ff_out); bug: log_softmax where softmax belongs."""

import torch
import torch.nn.functional as F
from torch import nn


class DotAttentionCell(nn.Module):
    def __init__(self, dropout=0.0, heads=1):
        super().__init__()
        self.dropout = nn.Dropout(p=dropout) if dropout > 0.0 else None
        self.heads = heads

    def forward(self, queries, key_values):
        # queries: (batch*heads, qlen, depth_per_head), already scaled
        # key_values: (batch*heads, kvlen, 2 * depth_per_head)
        keys, values = key_values.chunk(2, dim=-1)
        logits = torch.bmm(queries, keys.transpose(1, 2))
        probs = F.log_softmax(logits, dim=-1)
        if self.dropout is not None:
            probs = self.dropout(probs)
        return torch.bmm(probs, values)


class MultiHeadSelfAttention(nn.Module):
    """Inputs are time-major: (length, batch, depth_model)."""

    def __init__(self, depth_att=512, heads=8, depth_out=512, dropout=0.0):
        super().__init__()
        self.depth = depth_att
        self.heads = heads
        self.depth_out = depth_out
        self.depth_per_head = depth_att // heads
        self.ff_in = nn.Linear(depth_out, depth_att * 3, bias=False)
        self.dot_att = DotAttentionCell(dropout=dropout, heads=heads)
        self.ff_out = nn.Linear(depth_att, depth_out, bias=False)

    def _split_heads(self, x):
        # (length, batch, heads*d) -> (batch*heads, length, d)
        length, batch, _ = x.shape
        return x.reshape(length, batch * self.heads, -1).transpose(0, 1)

    def forward(self, inputs):
        length, batch, _ = inputs.shape
        combined = self.ff_in(inputs)
        queries, keys, values = combined.split(self.depth, dim=-1)
        queries = self._split_heads(queries) * self.depth_per_head**-0.5
        keys = self._split_heads(keys)
        values = self._split_heads(values)
        contexts = self.dot_att(queries, torch.cat((keys, values), dim=-1))
        contexts = contexts.transpose(0, 1).reshape(length, batch, self.depth)
        return self.ff_out(contexts)


class TransformerEncoderBlock(nn.Module):
    def __init__(self, model_size, attention_heads, feed_forward_num_hidden):
        super().__init__()
        self.pre_self_attention = nn.LayerNorm(model_size)
        self.self_attention = MultiHeadSelfAttention(
            depth_att=model_size, heads=attention_heads, depth_out=model_size
        )
        self.pre_ff = nn.LayerNorm(model_size)
        self.ff = nn.Sequential(
            nn.Linear(model_size, feed_forward_num_hidden),
            nn.ReLU(),
            nn.Linear(feed_forward_num_hidden, model_size),
        )

    def forward(self, data):
        data = data + self.self_attention(self.pre_self_attention(data))
        return data + self.ff(self.pre_ff(data))


class TransformerEncoder(nn.Module):
    def __init__(self, model_size=20, attention_heads=4, feed_forward_num_hidden=40, num_layers=1):
        super().__init__()
        self.layers = nn.ModuleList(
            [
                TransformerEncoderBlock(model_size, attention_heads, feed_forward_num_hidden)
                for _ in range(num_layers)
            ]
        )
        self.final_process = nn.LayerNorm(model_size)

    def forward(self, data):
        data = data.transpose(1, 0)  # (batch, length, d) -> (length, batch, d)
        for layer in self.layers:
            data = layer(data)
        return self.final_process(data).transpose(1, 0)


def make_encoder():
    return TransformerEncoder(model_size=20, attention_heads=4, feed_forward_num_hidden=40)


EXPECT = {
    "target": "make_encoder",
    "kind": "multihead",
    "ok": False,
    "stage": "weights",
    "mistake": "not_softmax",
    "layer": "layers.0.self_attention",
    "style": "Sockeye time-major encoder (ff_in split q/k/v, DotAttentionCell, ff_out; log_softmax)",
}

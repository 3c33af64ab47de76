"""Export-friendly bmm rewrite: keys folded (heads, batch) while queries/values are folded (batch, heads), so with batch > 1 a sequence's queries meet another sequence's keys."""

import math

import torch
from torch import nn


class BmmSelfAttention(nn.Module):
    def __init__(self, hidden_size=64, num_heads=4):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.query = nn.Linear(hidden_size, hidden_size)
        self.key = nn.Linear(hidden_size, hidden_size)
        self.value = nn.Linear(hidden_size, hidden_size)
        self.dense = nn.Linear(hidden_size, hidden_size)

    def fold_heads(self, x):
        b, t, _ = x.shape
        x = x.view(b, t, self.num_heads, self.head_dim).permute(0, 2, 1, 3)
        return x.reshape(b * self.num_heads, t, self.head_dim)

    def unfold_heads(self, x, b):
        bh, t, d = x.shape
        x = x.view(b, self.num_heads, t, d).permute(0, 2, 1, 3)
        return x.reshape(b, t, self.num_heads * d)

    def forward(self, hidden_states, padding_bias):
        b = hidden_states.shape[0]
        q = self.fold_heads(self.query(hidden_states))
        k = (
            self.key(hidden_states)
            .view(b, -1, self.num_heads, self.head_dim)
            .permute(2, 0, 1, 3)
            .reshape(-1, q.shape[1], self.head_dim)
        )
        v = self.fold_heads(self.value(hidden_states))
        scores = torch.baddbmm(padding_bias, q, k.transpose(1, 2), beta=1.0, alpha=self.scale)
        probs = torch.softmax(scores, dim=-1)
        context = torch.bmm(probs, v)
        return self.dense(self.unfold_heads(context, b))


class BmmEncoderLayer(nn.Module):
    def __init__(self, hidden_size=64, num_heads=4):
        super().__init__()
        self.num_heads = num_heads
        self.attention = BmmSelfAttention(hidden_size, num_heads)
        self.attention_norm = nn.LayerNorm(hidden_size, eps=1e-12)

    def forward(self, hidden_states):
        b, t, _ = hidden_states.shape
        padding_bias = hidden_states.new_zeros(b * self.num_heads, t, t)
        out = self.attention(hidden_states, padding_bias)
        return self.attention_norm(hidden_states + out)


def make_bmm_encoder_layer():
    torch.manual_seed(1008)
    layer = BmmEncoderLayer()
    with torch.no_grad():
        layer.attention_norm.weight.uniform_(0.5, 1.5)
        layer.attention_norm.bias.uniform_(-0.2, 0.2)
    return layer.eval()


EXPECT = {
    "target": "make_bmm_encoder_layer",
    "kind": "multihead",
    "ok": False,
    "layer": "attention",
    "stage": "scores",
    "mistake": "batch_mixing",
    "style": "export-friendly bmm rewrite: keys folded (heads, batch) while queries/values are folded "
    "(batch, heads), so with batch > 1 a sequence's queries meet another sequence's keys",
}

"""SASRec self-attentive sequential recommender (in the manner of kang205/SASRec modules.py
multihead_attention and its PyTorch port pmixer/SASRec.pytorch python/model.py): Q/K/V dense
layers with bias, heads cut from the last axis with chunk and stacked on the batch axis (head-
major, (h * N, T, d)), bmm scores divided by sqrt(head size), an optional model-built recency
bias, causality by tril with the (-2 ** 32 + 1) padding, softmax, bmm with the values, heads
restored by chunk/cat along the feature axis. Like the TF original, the attention has no output
projection. Pre-LayerNorm blocks with a point-wise feed-forward and a last LayerNorm.

This file: correct (4 heads of 16, model-built ALiBi recency bias -slope*|i-j|, slopes
2^-2..2^-8)."""

import torch
from torch import nn


class SASRecArgs:
    hidden_units = 64
    num_heads = 4
    maxlen = 64
    alibi = True


class SASRecAttention(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.num_heads = args.num_heads
        self.Q = nn.Linear(args.hidden_units, args.hidden_units)
        self.K = nn.Linear(args.hidden_units, args.hidden_units)
        self.V = nn.Linear(args.hidden_units, args.hidden_units)

    def forward(self, queries, keys, attn_bias=None):
        Q = self.Q(queries)
        K = self.K(keys)
        V = self.V(keys)
        Q_ = torch.cat(torch.chunk(Q, self.num_heads, dim=2), dim=0)
        K_ = torch.cat(torch.chunk(K, self.num_heads, dim=2), dim=0)
        V_ = torch.cat(torch.chunk(V, self.num_heads, dim=2), dim=0)

        outputs = torch.bmm(Q_, K_.transpose(1, 2))
        outputs = outputs / (K_.shape[-1] ** 0.5)
        if attn_bias is not None:
            outputs = outputs + attn_bias
        tril = torch.ones(outputs.shape[-2], outputs.shape[-1], dtype=torch.bool).tril()
        paddings = torch.full_like(outputs, -(2**32) + 1)
        outputs = torch.where(tril, outputs, paddings)
        outputs = torch.softmax(outputs, dim=-1)
        outputs = torch.bmm(outputs, V_)
        return torch.cat(torch.chunk(outputs, self.num_heads, dim=0), dim=2)


class PointWiseFeedForward(nn.Module):
    def __init__(self, hidden_units):
        super().__init__()
        self.conv1 = nn.Linear(hidden_units, hidden_units)
        self.conv2 = nn.Linear(hidden_units, hidden_units)

    def forward(self, x):
        return self.conv2(torch.relu(self.conv1(x)))


class SASRecBlock(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.attention_layernorm = nn.LayerNorm(args.hidden_units, eps=1e-8)
        self.attn = SASRecAttention(args)
        self.forward_layernorm = nn.LayerNorm(args.hidden_units, eps=1e-8)
        self.ffn = PointWiseFeedForward(args.hidden_units)

    def forward(self, seqs, attn_bias=None):
        Q = self.attention_layernorm(seqs)
        seqs = seqs + self.attn(Q, Q, attn_bias)
        return seqs + self.ffn(self.forward_layernorm(seqs))


def alibi_slopes(num_heads):
    return torch.tensor(
        [2.0 ** (-8.0 * (h + 1) / num_heads) for h in range(num_heads)], dtype=torch.float64
    )


class SASRec(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.pos_emb = None if args.alibi else nn.Embedding(args.maxlen, args.hidden_units)
        self.blocks = nn.ModuleList([SASRecBlock(args)])
        self.last_layernorm = nn.LayerNorm(args.hidden_units, eps=1e-8)

    def recency_bias(self, batch, seq_len, dtype):
        pos = torch.arange(seq_len, dtype=torch.float64)
        distance = (pos[:, None] - pos[None, :]).abs()
        bias = -alibi_slopes(self.args.num_heads)[:, None, None] * distance
        return bias.repeat_interleave(batch, dim=0).to(dtype)

    def forward(self, seqs):
        batch, seq_len, dim = seqs.shape
        seqs = seqs * dim**0.5
        attn_bias = None
        if self.args.alibi:
            attn_bias = self.recency_bias(batch, seq_len, seqs.dtype)
        else:
            seqs = seqs + self.pos_emb.weight[:seq_len].to(seqs.dtype)
        for block in self.blocks:
            seqs = block(seqs, attn_bias)
        return self.last_layernorm(seqs)


def make_sasrec_model():
    torch.manual_seed(3609)
    model = SASRec(SASRecArgs())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
            if isinstance(mod, nn.Linear):
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {
    "target": "make_sasrec_model",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "blocks.0.attn",
    "structure": {
        "heads": 4,
        "kv_heads": 4,
        "head_dim": 16,
        "causal": True,
        "cross": False,
        "rope": None,
        "qk_norm": None,
        "window": None,
        "bias": "alibi",
    },
    "style": "SASRec multihead_attention: correct (4 heads of 16, ALiBi recency bias "
    "-slope_h*|i-j| repeated head-major over the batch, no out projection)",
}

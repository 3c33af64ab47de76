"""THUMT's PyTorch Transformer decoder (thumt/models/transformer.py, thumt/modules/attention.py)
used as a decoder-only language model.

Transformer -> tgt_embedding (a Parameter, scaled by hidden_size ** 0.5, tied to the softmax
weights), bias, encoding (sinusoid timing signal, [sin | cos] halves, timescales 1 .. 1e4, added at
the absolute step `time` while decoding as THUMT's add_timing_signal(time=...) does), decoder
(TransformerDecoder: layers.N = TransformerDecoderLayer with self_attention (AttentionSubLayer:
attention + layer_norm, normalization "after", i.e. post-norm) and feed_forward (FFNSubLayer)).
The encoder and encdec_attention of the translation model are not built.  MultiHeadAttention:
q/k/v/o_transform with bias, cached k/v concatenated on the time axis (dim 1) *before* split_heads
and written back into state["k"] / state["v"], qh scaled by (hidden_size // num_heads) ** -0.5,
logits + bias where bias = -1e9 * (1 - tril) (attention_bias "causal"), softmax, combine_heads,
o_transform. Cache: book-cache: `cache = mod.KVCache(n_layers=N)` (THUMT's nested state dict,
{"decoder": {"layer_0": {"k": (b, 0, 64), "v": ...}, ...}, "time": 0}), `model(prompt,
cache=cache)`, then `model(tok, cache=cache)`; returns the logits tensor (b, s, 96).  `model(ids)`
is the full pass. `model.reset_kv_cache()` is a no-op.  More than 64 positions or a changed batch
raise ValueError. Slip: layer 1 (`value_from_key_layers=(1,)`) computes v = k_transform(query).
Decoding agrees with its own full pass.
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
        "decoder.layers.0.self_attention.attention",
        "decoder.layers.1.self_attention.attention",
        "decoder.layers.2.self_attention.attention",
    ],
    "kind": "causal-multihead",
    "cache": "book-cache",
    "layer": "decoder.layers.1.self_attention.attention",
    "stage": "values",
    "mistake": "wrong_projection",
    "style": "THUMT as 02; layer 1 projects the values with k_transform (v_transform "
    "built, unused)",
}


class KVCache(dict):
    """THUMT's decoder state: {"decoder": {"layer_%d": {"k", "v"}}, "time": int}."""

    def __init__(self, n_layers, max_sequence_length=64):
        super().__init__()
        self.n_layers = n_layers
        self.max_sequence_length = max_sequence_length
        self.batch_size = None
        self["decoder"] = {f"layer_{i}": {"k": None, "v": None} for i in range(n_layers)}
        self["time"] = 0

    def get_seq_length(self):
        return self["time"]

    def prepare(self, batch, length, dtype, device, hidden):
        if self.batch_size is None:
            self.batch_size = batch
            for layer in self["decoder"].values():
                layer["k"] = torch.zeros(batch, 0, hidden, dtype=dtype, device=device)
                layer["v"] = torch.zeros(batch, 0, hidden, dtype=dtype, device=device)
        if batch != self.batch_size:
            raise ValueError("cache was made for another batch size")
        if self["time"] + length > self.max_sequence_length:
            raise ValueError("sequence longer than the cache")


def attention_bias(length, dtype, device, inf=-1e9):
    ret = torch.tril(torch.ones(length, length, dtype=dtype, device=device))
    return (inf * (1.0 - ret))[None, None]


def timing_signal(length, channels, time, dtype, device, min_timescale=1.0, max_timescale=1.0e4):
    position = torch.arange(length, dtype=torch.float64, device=device) + time
    num_timescales = channels // 2
    log_inc = math.log(max_timescale / min_timescale) / max(num_timescales - 1, 1)
    inv = min_timescale * torch.exp(
        torch.arange(num_timescales, dtype=torch.float64, device=device) * -log_inc
    )
    scaled = position[:, None] * inv[None, :]
    return torch.cat([torch.sin(scaled), torch.cos(scaled)], dim=1).to(dtype)


class MultiHeadAttention(nn.Module):
    def __init__(self, hidden_size, num_heads, scale_slip=False, value_from_key=False):
        super().__init__()
        self.num_heads = num_heads
        self.hidden_size = hidden_size
        self.q_transform = nn.Linear(hidden_size, hidden_size)
        self.k_transform = nn.Linear(hidden_size, hidden_size)
        self.v_transform = nn.Linear(hidden_size, hidden_size)
        self.o_transform = nn.Linear(hidden_size, hidden_size)
        self.scale_slip = scale_slip
        self.value_from_key = value_from_key

    @staticmethod
    def split_heads(x, heads):
        batch, length, channels = x.shape
        return x.reshape(batch, length, heads, channels // heads).transpose(1, 2)

    @staticmethod
    def combine_heads(x):
        batch, heads, length, channels = x.shape
        return x.transpose(1, 2).reshape(batch, length, heads * channels)

    def forward(self, query, bias, memory=None, kv=None, state=None):
        q = self.q_transform(query)
        k = self.k_transform(query)
        v = (self.k_transform if self.value_from_key else self.v_transform)(query)
        if state is not None:
            k = torch.cat([state["k"], k], dim=1)
            v = torch.cat([state["v"], v], dim=1)
            state["k"] = k
            state["v"] = v
        qh = self.split_heads(q, self.num_heads)
        kh = self.split_heads(k, self.num_heads)
        vh = self.split_heads(v, self.num_heads)
        if self.scale_slip:
            qh = qh * (self.hidden_size // self.num_heads**-0.5)
        else:
            qh = qh * (self.hidden_size // self.num_heads) ** -0.5
        logits = torch.matmul(qh, kh.transpose(-2, -1))
        if bias is not None:
            logits = logits + bias
        weights = torch.softmax(logits, dim=-1)
        x = torch.matmul(weights, vh)
        return self.o_transform(self.combine_heads(x))


class AttentionSubLayer(nn.Module):
    def __init__(self, params, layer_idx):
        super().__init__()
        self.attention = MultiHeadAttention(
            params.hidden_size,
            params.num_heads,
            scale_slip=layer_idx in params.scale_slip_layers,
            value_from_key=layer_idx in params.value_from_key_layers,
        )
        self.layer_norm = nn.LayerNorm(params.hidden_size)

    def forward(self, x, bias, state=None):
        y = self.attention(x, bias, state=state)
        return self.layer_norm(x + y)


class FFNSubLayer(nn.Module):
    def __init__(self, params):
        super().__init__()
        self.input_transform = nn.Linear(params.hidden_size, params.filter_size)
        self.output_transform = nn.Linear(params.filter_size, params.hidden_size)
        self.layer_norm = nn.LayerNorm(params.hidden_size)

    def forward(self, x):
        y = self.output_transform(F.relu(self.input_transform(x)))
        return self.layer_norm(x + y)


class TransformerDecoderLayer(nn.Module):
    def __init__(self, params, layer_idx):
        super().__init__()
        self.self_attention = AttentionSubLayer(params, layer_idx)
        self.feed_forward = FFNSubLayer(params)

    def forward(self, x, attn_bias, state=None):
        return self.feed_forward(self.self_attention(x, attn_bias, state))


class TransformerDecoder(nn.Module):
    def __init__(self, params):
        super().__init__()
        self.layers = nn.ModuleList(
            [TransformerDecoderLayer(params, i) for i in range(params.num_decoder_layers)]
        )

    def forward(self, x, attn_bias, state=None):
        for i, layer in enumerate(self.layers):
            layer_state = state["decoder"][f"layer_{i}"] if state is not None else None
            x = layer(x, attn_bias, layer_state)
        return x


class Transformer(nn.Module):
    def __init__(self, params):
        super().__init__()
        self.params = params
        self.hidden_size = params.hidden_size
        self.tgt_embedding = nn.Parameter(torch.randn(params.vocab_size, params.hidden_size))
        self.bias = nn.Parameter(torch.zeros(params.hidden_size))
        self.decoder = TransformerDecoder(params)

    def reset_kv_cache(self):
        pass

    def forward(self, input_ids, cache=None):
        batch, length = input_ids.shape
        dtype, device = self.tgt_embedding.dtype, input_ids.device
        time = 0
        if cache is not None:
            cache.prepare(batch, length, dtype, device, self.hidden_size)
            time = cache["time"]
        elif length > 64:
            raise ValueError("sequence longer than 64 positions")
        x = F.embedding(input_ids, self.tgt_embedding) * self.hidden_size**0.5
        x = x + self.bias
        signal_time = 0 if self.params.timing_restarts_per_call else time
        x = x + timing_signal(length, self.hidden_size, signal_time, dtype, device)[None]
        bias = attention_bias(time + length, dtype, device)[:, :, time:, :]
        x = self.decoder(x, bias, cache)
        if cache is not None:
            cache["time"] = time + length
        return x @ self.tgt_embedding.t()


def make_model():
    torch.manual_seed(3209)
    params = SimpleNamespace(
        vocab_size=96,
        hidden_size=64,
        filter_size=128,
        num_heads=4,
        num_decoder_layers=3,
        scale_slip_layers=(),
        value_from_key_layers=(1,),
        timing_restarts_per_call=False,
    )
    model = Transformer(params)
    g = torch.Generator().manual_seed(32091)
    with torch.no_grad():
        model.tgt_embedding.mul_(0.125)
        model.bias.normal_(0.0, 0.1, generator=g)
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
            elif isinstance(m, nn.Linear):
                m.bias.copy_(0.05 * torch.randn(m.bias.shape, generator=g))
    return model.eval()

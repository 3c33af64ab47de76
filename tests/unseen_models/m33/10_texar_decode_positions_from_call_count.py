"""texar-pytorch's GPT2Decoder ported as a standalone language model (asyml/texar-pytorch,
texar/torch/modules/decoders/transformer_decoders.py and encoders/multihead_attention.py).

GPT2LanguageModel: word_embedder / position_embedder (learned, `embedding` parameters), decoder
(TransformerDecoder: self_attns.N, self_attn_layer_norm.N, poswise_networks.N,
poswise_layer_norm.N, final_layer_norm; pre-norm), output tied to the word embedding.
MultiheadAttentionEncoder: Q_dense/K_dense/V_dense/O_dense with bias, `_update_and_return`
concatenates the projected keys/values onto the layer cache before the heads are split,
Q_ *= key_depth_per_head ** -0.5, additive -1e18 lower-triangle bias, softmax, _combine_heads.
Slip: `positions_from_call_count`: after a P-token prompt the first step is embedded at
position 1 instead of P (and so on), while the keys and the mask are right.  Full pass and
prompt pass exact; with a one-token prompt the count equals the length and nothing diverges,
so the expected step 0 assumes a prompt of at least 2 tokens.
Cache: book-cache: `cache = mod.KVCache(n_layers=N)` (texar's {'layers': [{'keys', 'values'}]} dict,
projected (b, T, 64) tensors grown on dim 1), `model(prompt, cache=cache)`, then
`model(tok, cache=cache)`; returns the logits tensor (b, s, 96).  `model(ids)` is the full pass;
`model.reset_kv_cache()` is a no-op; a fresh cache per sequence; `cache.get_seq_length()`.
One-token cached calls pass no attention bias (texar's step function); longer cached calls get
the lower-triangle bias shifted by the cache length.
"""

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["decoder.self_attns.0", "decoder.self_attns.1"],
    "kind": "causal-multihead",
    "cache": "book-cache",
    "decode": {
        "mistake": "cache_positions",
        "step": 0,
        "layer": "decoder.self_attns.0",
    },
    "style": "texar as 01 (2 layers); the decoding position offset is the number of calls made on the "
    "cache (texar's step counter) instead of the number of cached steps",
}


class KVCache(dict):
    """texar's decoding cache for a decoder without memory: {'layers': [{'keys', 'values'}, ...]}.

    Keys and values are kept as projected (batch, steps, num_units) tensors, heads not split, and
    grown on dim 1 (texar's "beam-search" tensor form).  'calls' counts forward calls.
    """

    def __init__(self, n_layers, max_decoding_length=64):
        super().__init__()
        self.max_decoding_length = max_decoding_length
        self["layers"] = [{"keys": None, "values": None} for _ in range(n_layers)]
        self["calls"] = 0

    def get_seq_length(self):
        keys = self["layers"][0]["keys"]
        return 0 if keys is None else keys.size(1)

    def _init(self, batch, num_units, dtype, device):
        for layer_cache in self["layers"]:
            if layer_cache["keys"] is None:
                layer_cache["keys"] = torch.zeros(
                    batch, 0, num_units, dtype=dtype, device=device
                )
                layer_cache["values"] = torch.zeros(
                    batch, 0, num_units, dtype=dtype, device=device
                )
            elif layer_cache["keys"].size(0) != batch:
                raise ValueError("the cache was started with another batch size")


def attention_bias_lower_triangle(length, past=0, dtype=torch.float32, device=None):
    """texar.torch.utils.transformer_attentions: -1e18 above the band, 0 inside it."""
    rows = torch.arange(past, past + length, device=device)[:, None]
    cols = torch.arange(past + length, device=device)[None, :]
    band = (cols <= rows).to(dtype)
    return (-1e18 * (1.0 - band))[None, None]


class WordEmbedder(nn.Module):
    def __init__(self, vocab_size, dim):
        super().__init__()
        self.embedding = nn.Parameter(torch.randn(vocab_size, dim) * 0.3)

    def forward(self, ids):
        return F.embedding(ids, self.embedding)


class PositionEmbedder(nn.Module):
    def __init__(self, position_size, dim):
        super().__init__()
        self.embedding = nn.Parameter(torch.randn(position_size, dim) * 0.3)

    def forward(self, positions):
        if int(positions.max()) >= self.embedding.size(0):
            raise ValueError("position beyond the position table")
        return F.embedding(positions, self.embedding)


class MultiheadAttentionEncoder(nn.Module):
    """texar.torch.modules.MultiheadAttentionEncoder (self-attention use, memory None)."""

    def __init__(self, input_size, hparams):
        super().__init__()
        self._hparams = hparams
        units = hparams.num_units
        self.Q_dense = nn.Linear(input_size, units, bias=hparams.use_bias)
        self.K_dense = nn.Linear(input_size, units, bias=hparams.use_bias)
        self.V_dense = nn.Linear(input_size, units, bias=hparams.use_bias)
        self.O_dense = nn.Linear(units, hparams.output_dim, bias=hparams.use_bias)
        self.query_dense_name = "Q_dense"
        self.combine_order = (0, 2, 1, 3)

    def forward(self, queries, memory, memory_attention_bias, cache=None):
        num_heads = self._hparams.num_heads
        num_units = self._hparams.num_units

        def _update_and_return(layer, key):
            out = layer(queries)
            if cache is not None:
                res = torch.cat([cache[key], out], dim=1)
                cache[key] = res
                out = res
            return out

        Q = getattr(self, self.query_dense_name)(queries)
        K = _update_and_return(self.K_dense, "keys")
        V = _update_and_return(self.V_dense, "values")

        Q_ = self._split_heads(Q)
        K_ = self._split_heads(K)
        V_ = self._split_heads(V)
        key_depth_per_head = num_units // num_heads
        Q_ = Q_ * key_depth_per_head**-0.5

        logits = torch.matmul(Q_, K_.transpose(-2, -1))
        if memory_attention_bias is not None:
            logits = logits + memory_attention_bias.to(dtype=logits.dtype)
        weights = torch.softmax(logits, dim=-1)
        outputs = torch.matmul(weights, V_)
        outputs = self._combine_heads(outputs)
        return self.O_dense(outputs)

    def _split_heads(self, x):
        depth = x.size(-1)
        split_x = torch.reshape(
            x,
            (
                x.size(0),
                x.size(1),
                self._hparams.num_heads,
                depth // self._hparams.num_heads,
            ),
        )
        return split_x.permute((0, 2, 1, 3))

    def _combine_heads(self, x):
        t = x.permute(self.combine_order)
        return torch.reshape(t, (t.size(0), t.size(1), t.size(2) * t.size(3)))


class TransformerDecoder(nn.Module):
    """texar.torch.modules.TransformerDecoder as used by GPT2Decoder: pre-norm blocks."""

    def __init__(self, hparams):
        super().__init__()
        self._hparams = hparams
        dim = hparams.dim
        self.self_attns = nn.ModuleList()
        self.self_attn_layer_norm = nn.ModuleList()
        self.poswise_networks = nn.ModuleList()
        self.poswise_layer_norm = nn.ModuleList()
        for _ in range(hparams.num_blocks):
            self.self_attns.append(
                MultiheadAttentionEncoder(dim, hparams.multihead_attention)
            )
            self.self_attn_layer_norm.append(nn.LayerNorm(dim, eps=hparams.eps))
            self.poswise_networks.append(
                nn.Sequential(
                    nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)
                )
            )
            self.poswise_layer_norm.append(nn.LayerNorm(dim, eps=hparams.eps))
        self.final_layer_norm = nn.LayerNorm(dim, eps=hparams.eps)

    def _self_attention_stack(self, inputs, decoder_self_attention_bias, cache=None):
        x = inputs
        for i in range(self._hparams.num_blocks):
            layer_cache = cache["layers"][i] if cache is not None else None
            selfatt_output = self.self_attns[i](
                queries=self.self_attn_layer_norm[i](x),
                memory=None,
                memory_attention_bias=decoder_self_attention_bias,
                cache=layer_cache,
            )
            x = x + selfatt_output
            x = x + self.poswise_networks[i](self.poswise_layer_norm[i](x))
        return self.final_layer_norm(x)


class GPT2LanguageModel(nn.Module):
    """texar GPT2Decoder: word + position embedders, TransformerDecoder, output tied to words."""

    def __init__(self, hparams):
        super().__init__()
        self._hparams = hparams
        self.word_embedder = WordEmbedder(hparams.vocab_size, hparams.dim)
        self.position_embedder = PositionEmbedder(hparams.position_size, hparams.dim)
        self.decoder = TransformerDecoder(hparams)
        self.positions_from_call_count = False

    def reset_kv_cache(self):
        return None

    def embed_tokens(self, tokens, positions):
        return self.word_embedder(tokens) + self.position_embedder(positions)

    def forward(self, input_ids, cache=None):
        batch, length = input_ids.shape
        past = 0
        if cache is not None:
            past = (
                cache["calls"]
                if self.positions_from_call_count
                else cache.get_seq_length()
            )
            if cache.get_seq_length() + length > cache.max_decoding_length:
                raise ValueError("more positions than max_decoding_length")
        times = torch.arange(
            past, past + length, dtype=torch.long, device=input_ids.device
        )
        times = times.unsqueeze(0).expand(batch, -1)
        inputs = self.embed_tokens(input_ids, times)
        if cache is not None:
            cache._init(batch, self._hparams.dim, inputs.dtype, inputs.device)
            cache["calls"] += 1
            if length == 1:
                # texar's step function: one new token sees every cached step, no bias
                bias = None
            else:
                bias = attention_bias_lower_triangle(
                    length, cache.get_seq_length(), inputs.dtype, inputs.device
                )
        else:
            bias = attention_bias_lower_triangle(length, 0, inputs.dtype, inputs.device)
        outputs = self.decoder._self_attention_stack(inputs, bias, cache=cache)
        return F.linear(outputs, self.word_embedder.embedding)


def make_model():
    torch.manual_seed(3310)
    hparams = SimpleNamespace(
        vocab_size=96,
        dim=64,
        position_size=64,
        num_blocks=2,
        eps=1e-5,
        multihead_attention=SimpleNamespace(
            num_heads=4, num_units=64, output_dim=64, use_bias=True, dropout_rate=0.0
        ),
    )
    model = GPT2LanguageModel(hparams)
    g = torch.Generator().manual_seed(3310 * 10 + 1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    model.positions_from_call_count = True
    return model.eval()

"""An MPT causal LM written the way explosion/curated-transformers builds its decoders, 2 layers, 4 heads.

As 04: decoder.layers.N.mha = SelfAttention (MERGED_SPLIT_AFTER `input` Linear, `output` Linear),
1/sqrt(head_width), AttentionLinearBiases (causal, from the last key), -10000.0 mask fill, bias-free
LayerNorms, tied piece embeddings; per-layer KeyValueCache entries in `KVCache(n_layers=2)`.
Slip (decode only): this copy of the `KeyValueCache` dataclass declares its fields as (value, key)
(sorted while adding a `filter_batch_items` helper), while SelfAttention still builds it positionally
as KeyValueCache(key, value); reading `cache.key` returns the cached values and vice versa.  Shapes
agree, so nothing raises: from the first decoded token on, the cached rows come back swapped.
The full forward and the prompt pass never read a cache and are exact.
Cache (book-cache): `cache = mod.KVCache(n_layers=2)`, `model(prompt, cache=cache)`,
`model(tok, cache=cache)`; `model.reset_kv_cache()` is a no-op.  Returns the logits tensor.
"""

import math
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": [
        "decoder.layers.0.mha",
        "decoder.layers.1.mha",
    ],
    "kind": "causal-multihead",
    "cache": "book-cache",
    "decode": {
        "mistake": "cache_other",
        "step": 0,
        "layer": "decoder.layers.0.mha",
    },
    "style": "curated-transformers MPT, ALiBi, KeyValueCache entries; the dataclass declares (value, key) while "
    "SelfAttention builds it positionally as (key, value): cached keys and values swapped, no exception",
}


@dataclass
class KeyValueCache:
    value: torch.Tensor
    key: torch.Tensor

    def filter_batch_items(self, mask):
        return KeyValueCache(self.value[mask], self.key[mask])


class KVCache:
    def __init__(self, n_layers):
        self.entries = [None] * n_layers

    def get(self, i):
        return self.entries[i]

    def update(self, i, entry):
        self.entries[i] = entry

    def seq_len(self):
        e = self.entries[0]
        return 0 if e is None else e.key.shape[-2]


class AttentionLinearBiases(nn.Module):
    def __init__(self, *, n_attention_heads, is_causal, is_inverted, alibi_bias_max=8.0):
        super().__init__()
        self.is_causal = is_causal
        self.is_inverted = is_inverted
        self.alibi_bias_max = alibi_bias_max
        self.slopes64 = self._calculate_slopes(n_attention_heads)

    def _calculate_slopes(self, n_attention_heads):
        def _slopes_with_step(n, step=1):
            ratio = 2.0 ** (-self.alibi_bias_max / n)
            return ratio ** torch.arange(1, 1 + n, step, dtype=torch.float64)

        if math.log2(n_attention_heads).is_integer():
            slopes = _slopes_with_step(n_attention_heads)
        else:
            closest_power_of_2 = 2 ** math.floor(math.log2(n_attention_heads))
            slopes = _slopes_with_step(closest_power_of_2)
            slopes_rest = _slopes_with_step(2 * closest_power_of_2, step=2)
            slopes = torch.cat([slopes, slopes_rest[: n_attention_heads - closest_power_of_2]])
        return slopes.view(1, -1, 1, 1)

    def calculate_biases(self, seq_len):
        if self.is_causal:
            distances = torch.arange(1 - seq_len, 1, dtype=torch.float64)
        else:
            distances = torch.arange(seq_len, dtype=torch.float64) - torch.arange(seq_len, dtype=torch.float64).view(-1, 1)
            distances = distances.abs().mul(-1).view(1, 1, seq_len, seq_len)
        biases = distances * self.slopes64
        if self.is_inverted:
            biases = biases - biases.amax(dim=-1, keepdim=True)
        return biases

    def forward(self, *, attention_scores, inplace=True):
        biases = self.calculate_biases(attention_scores.size(-1)).to(attention_scores.dtype)
        if inplace:
            return attention_scores.add_(biases)
        return attention_scores + biases


class ScaledDotProductAttention(nn.Module):
    def __init__(self, *, linear_biases=None):
        super().__init__()
        self.linear_biases = linear_biases

    def forward(self, *, query, key, value):
        model_width = key.shape[-1]
        attn_scores = query @ key.transpose(-2, -1)
        attn_scores = attn_scores / math.sqrt(model_width)
        if self.linear_biases is not None:
            attn_scores = self.linear_biases(attention_scores=attn_scores, inplace=True)
        q_len, k_len = query.size(-2), key.size(-2)
        causal = torch.ones(k_len, k_len, dtype=torch.bool, device=query.device).tril()[k_len - q_len :, :k_len]
        attn_scores = attn_scores.masked_fill(~causal[None, None], -10000.0)
        attn_weights = attn_scores.softmax(dim=-1)
        return attn_weights @ value


class SelfAttention(nn.Module):
    def __init__(self, *, hidden_width, n_query_heads, alibi_bias_max=8.0):
        super().__init__()
        self.n_heads = n_query_heads
        self.head_width = hidden_width // n_query_heads
        self.input = nn.Linear(hidden_width, 3 * hidden_width, bias=False)
        self.output = nn.Linear(hidden_width, hidden_width, bias=False)
        self.attention = ScaledDotProductAttention(
            linear_biases=AttentionLinearBiases(
                n_attention_heads=n_query_heads, is_causal=True, is_inverted=False, alibi_bias_max=alibi_bias_max
            )
        )

    def _split_heads(self, x):
        b, s, _ = x.shape
        return x.view(b, s, self.n_heads, self.head_width).transpose(1, 2)

    def _combine_heads(self, x):
        b, h, s, d = x.shape
        return x.transpose(1, 2).reshape(b, s, h * d)

    def forward(self, input, cache=None, store_cache=False):
        proj = self.input(input)
        query, key, value = proj.chunk(3, dim=-1)  # QkvMode.MERGED_SPLIT_AFTER
        query, key, value = self._split_heads(query), self._split_heads(key), self._split_heads(value)
        if cache is not None:
            key = torch.cat([cache.key, key], dim=-2)
            value = torch.cat([cache.value, value], dim=-2)
        output_cache = KeyValueCache(key, value) if store_cache else None
        attn = self.attention(query=query, key=key, value=value)
        return self.output(self._combine_heads(attn)), output_cache


class PointwiseFeedForward(nn.Module):
    def __init__(self, hidden_width, intermediate_width):
        super().__init__()
        self.intermediate = nn.Linear(hidden_width, intermediate_width, bias=False)
        self.output = nn.Linear(intermediate_width, hidden_width, bias=False)

    def forward(self, x):
        return self.output(F.gelu(self.intermediate(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg, alibi_bias_max):
        super().__init__()
        self.mha = SelfAttention(hidden_width=cfg.hidden_width, n_query_heads=cfg.n_heads, alibi_bias_max=alibi_bias_max)
        self.attn_input_layer_norm = nn.LayerNorm(cfg.hidden_width, eps=cfg.layer_norm_eps, bias=False)
        self.ffn = PointwiseFeedForward(cfg.hidden_width, cfg.intermediate_width)
        self.ffn_input_layer_norm = nn.LayerNorm(cfg.hidden_width, eps=cfg.layer_norm_eps, bias=False)

    def forward(self, x, cache=None, store_cache=False):
        attn_out, cache_out = self.mha(self.attn_input_layer_norm(x), cache=cache, store_cache=store_cache)
        x = x + attn_out
        return x + self.ffn(self.ffn_input_layer_norm(x)), cache_out


class TransformerEmbeddings(nn.Module):
    def __init__(self, n_pieces, width):
        super().__init__()
        self.piece_embeddings = nn.Embedding(n_pieces, width)

    def forward(self, piece_ids):
        return self.piece_embeddings(piece_ids)


class MPTDecoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embeddings = TransformerEmbeddings(cfg.n_pieces, cfg.hidden_width)
        bias_max = cfg.layer_alibi_bias_max
        self.layers = nn.ModuleList([DecoderLayer(cfg, bias_max[i]) for i in range(cfg.n_layers)])
        self.output_layer_norm = nn.LayerNorm(cfg.hidden_width, eps=cfg.layer_norm_eps, bias=False)

    def forward(self, piece_ids, cache=None):
        x = self.embeddings(piece_ids)
        for i, layer in enumerate(self.layers):
            entry = cache.get(i) if cache is not None else None
            x, new_entry = layer(x, cache=entry, store_cache=cache is not None)
            if cache is not None:
                cache.update(i, new_entry)
        return self.output_layer_norm(x)


class MPTCausalLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.decoder = MPTDecoder(cfg)

    def reset_kv_cache(self):
        pass

    def forward(self, piece_ids, cache=None):
        hidden = self.decoder(piece_ids, cache=cache)
        return hidden @ self.decoder.embeddings.piece_embeddings.weight.T


def make_model():
    torch.manual_seed(2513)
    cfg = SimpleNamespace(
        n_pieces=96, hidden_width=64, n_heads=4, intermediate_width=128, n_layers=2,
        layer_norm_eps=1e-5, layer_alibi_bias_max=(8.0, 8.0),
    )
    model = MPTCausalLM(cfg)
    g = torch.Generator().manual_seed(25131)
    with torch.no_grad():
        model.decoder.embeddings.piece_embeddings.weight.normal_(0.0, 0.5, generator=g)
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

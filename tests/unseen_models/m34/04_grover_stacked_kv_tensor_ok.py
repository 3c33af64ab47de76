"""Grover (rowanz/grover, lm/modeling.py) ported from TensorFlow to torch module by module.

newslm: word_embed / pos_embed tables, embed_norm (LayerNorm after the embedding sum), layer00,
layer01, ... each = attention (attention_layer: query_layer / key_layer / value_layer dense, heads
[batch, heads, seq, 16], scores * 1/sqrt(16), mask_attention_for_ltr: scores * m - 1e10 * (1 - m),
context_projection_layer) and residual_mlp (mlp_ln0 -> intermediate (gelu) -> output, mlp_ln1 on the
residual sum; the layer input is hidden + attention output).  Logits are tied to word_embed.
Cache: hf: `out = model(ids, use_cache=True)`, then
`model(tok, past_key_values=out.past_key_values, use_cache=True)`; `out.logits`.  past_key_values is
ONE tensor [batch, num_layers, 2, heads, past, 16]; the position offset is its past length.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": [
        "newslm.layer00.attention",
        "newslm.layer01.attention",
        "newslm.layer02.attention",
    ],
    "kind": "causal-multihead",
    "cache": "hf",
    "structure": {
        "heads": 4,
        "kv_heads": 4,
        "head_dim": 16,
        "causal": True,
        "cross": False,
        "rope": None,
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "Grover: q/k/v dense, 1e10 multiplicative mask, embed_norm, residual_mlp post-norm, tied "
    "logits, one stacked [b, L, 2, h, T, d] cache tensor; 3 layers",
}


def gelu(x):
    return (
        0.5
        * x
        * (1.0 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * torch.pow(x, 3))))
    )


def get_attention_mask(nd, ns, dtype, device):
    """1.0 where query i (of nd, the last nd of ns positions) may see key j."""
    i = torch.arange(nd, device=device)[:, None]
    j = torch.arange(ns, device=device)
    return (i >= j - ns + nd).to(dtype)


def mask_attention_for_ltr(attention_scores, attention_mask):
    mask = attention_mask[None, None]
    return attention_scores * mask - 1e10 * (1 - mask)


class GroverAttention(nn.Module):
    """lm/modeling.py attention_layer: query_layer / key_layer / value_layer dense projections,
    heads as [batch, heads, seq, size_per_head], cache [batch, 2, heads, past, size_per_head]."""

    def __init__(self, hidden_size, num_attention_heads):
        super().__init__()
        self.num_attention_heads = num_attention_heads
        self.size_per_head = hidden_size // num_attention_heads
        self.query_layer = nn.Linear(hidden_size, hidden_size)
        self.key_layer = nn.Linear(hidden_size, hidden_size)
        self.value_layer = nn.Linear(hidden_size, hidden_size)
        self.context_projection_layer = nn.Linear(hidden_size, hidden_size)

    def _projection_and_transpose(self, x, dense):
        b, s, _ = x.shape
        projected = dense(x).reshape(b, s, self.num_attention_heads, self.size_per_head)
        return projected.permute(0, 2, 1, 3)

    def _key(self, x):
        return self._projection_and_transpose(x, self.key_layer)

    def _probs(self, attention_scores):
        return torch.softmax(attention_scores, dim=-1)

    def forward(self, x, attention_mask, cache=None, do_cache=False):
        b, s, _ = x.shape
        query = self._projection_and_transpose(x, self.query_layer)
        key = self._key(x)
        value = self._projection_and_transpose(x, self.value_layer)
        cached_keys_and_values = torch.stack([key, value], dim=1) if do_cache else None
        if cache is not None:
            pk, pv = cache.unbind(1)
            key = torch.cat([pk, key], dim=-2)
            value = torch.cat([pv, value], dim=-2)
        attention_scores = torch.matmul(query, key.transpose(-1, -2))
        attention_scores = attention_scores * (
            1.0 / math.sqrt(float(self.size_per_head))
        )
        attention_scores = mask_attention_for_ltr(attention_scores, attention_mask)
        attention_probs = self._probs(attention_scores)
        context_layer = torch.matmul(attention_probs, value)
        context_layer = context_layer.permute(0, 2, 1, 3).reshape(
            b, s, self.num_attention_heads * self.size_per_head
        )
        return self.context_projection_layer(context_layer), cached_keys_and_values


ATTENTION_CLASSES = {"grover": GroverAttention}


class ResidualMLP(nn.Module):
    """residual_mlp_layer: x_norm = mlp_ln0(x); out = mlp_ln1(x + output(gelu(intermediate(x_norm))))."""

    def __init__(self, hidden_size, intermediate_size):
        super().__init__()
        self.mlp_ln0 = nn.LayerNorm(hidden_size, eps=1e-5)
        self.intermediate = nn.Linear(hidden_size, intermediate_size)
        self.output = nn.Linear(intermediate_size, hidden_size)
        self.mlp_ln1 = nn.LayerNorm(hidden_size, eps=1e-5)

    def forward(self, x):
        x_norm = self.mlp_ln0(x)
        return self.mlp_ln1(x + self.output(gelu(self.intermediate(x_norm))))


class GroverLayer(nn.Module):
    def __init__(self, config, attention):
        super().__init__()
        self.attention = ATTENTION_CLASSES[attention](
            config.hidden_size, config.num_attention_heads
        )
        self.residual_mlp = ResidualMLP(config.hidden_size, config.intermediate_size)

    def forward(self, hidden_state, mask, cache=None, do_cache=False):
        attention_output, new_kv = self.attention(
            hidden_state, mask, cache=cache, do_cache=do_cache
        )
        return self.residual_mlp(hidden_state + attention_output), new_kv


class NewsLM(nn.Module):
    """The 'newslm' scope: word_embed / pos_embed tables, embed_norm, layer00, layer01, ..."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.word_embed = nn.Parameter(
            torch.randn(config.vocab_size, config.hidden_size) * 0.3
        )
        self.pos_embed = nn.Parameter(
            torch.randn(config.max_position_embeddings, config.hidden_size)
        )
        self.embed_norm = nn.LayerNorm(config.hidden_size, eps=1e-5)
        for i in range(config.num_hidden_layers):
            setattr(self, f"layer{i:02d}", GroverLayer(config, config.attention[i]))

    def layers(self):
        return [
            getattr(self, f"layer{i:02d}") for i in range(self.config.num_hidden_layers)
        ]


class GroverModel(nn.Module):
    """Grover's GroverModel as a causal LM.  Cache (hf style): past_key_values is one tensor
    [batch, num_layers, 2, heads, past, size_per_head]; each layer gets its [:, i] slice, new_kvs are
    stacked on axis 1 and appended on the token axis (the concat that Grover's sampling loop does)."""

    def __init__(self, config):
        super().__init__()
        self.newslm = NewsLM(config)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        s = input_ids.shape[1]
        lm = self.newslm
        position_offset = 0 if past_key_values is None else past_key_values.shape[-2]
        positions = torch.arange(
            position_offset, position_offset + s, device=input_ids.device
        )
        hidden_state = (
            F.embedding(input_ids, lm.word_embed) + lm.pos_embed[positions][None]
        )
        hidden_state = lm.embed_norm(hidden_state)
        mask = get_attention_mask(
            s, s + position_offset, hidden_state.dtype, input_ids.device
        )
        caches = (
            [None] * len(lm.layers())
            if past_key_values is None
            else past_key_values.unbind(1)
        )
        new_kvs = []
        for layer, layer_cache in zip(lm.layers(), caches):
            hidden_state, new_kv = layer(
                hidden_state, mask, cache=layer_cache, do_cache=use_cache
            )
            new_kvs.append(new_kv)
        logits = torch.matmul(hidden_state, lm.word_embed.t())
        present = None
        if use_cache:
            new_kvs = torch.stack(new_kvs, dim=1)
            present = (
                new_kvs
                if past_key_values is None
                else torch.cat([past_key_values, new_kvs], dim=-2)
            )
        return SimpleNamespace(logits=logits, past_key_values=present)


def make_model():
    torch.manual_seed(3404)
    config = SimpleNamespace(
        vocab_size=96,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=192,
        max_position_embeddings=64,
        attention=["grover", "grover", "grover"],
    )
    model = GroverModel(config)
    g = torch.Generator().manual_seed(34041)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model.eval()

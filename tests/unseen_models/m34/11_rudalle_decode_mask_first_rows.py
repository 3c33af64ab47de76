"""ruDALL-E's transformer (ai-forever/ru-dalle, rudalle/dalle/transformer.py) as a causal LM over text ids.

text_embeddings + text_pos_embeddings (learned), transformer.layers.N (DalleTransformerLayer:
input_layernorm, attention = DalleSelfAttention with fused query_key_value and dense, CogView sandwich
LayerNorms before each residual addition, post_attention_layernorm, gelu MLP dense_h_to_4h /
dense_4h_to_h), transformer.final_layernorm, to_logits (LayerNorm + Linear).  Scores are
q.k / sqrt(16); the left-to-right mask is multiplicative: scores * m - 10000 * (1 - m).
The image-grid row / column / conv layer masks are not built (text only).
Cache: book-buffers.  As in rudalle, a cached call runs the *whole* id sequence: the model keeps the
ids and the per-layer cache tuples (keys, values, output); each attention projects only the rows
after the cached ones, concatenates the cached per-head keys / values (b, 4, T, 16) and returns the
whole (b, T, 64) output with the cached output rows first.  `model.reset_kv_cache()`,
`model(prompt, use_cache=True)`, `model(tok, use_cache=True)` (logits of the new rows);
`model(ids)` ignores the buffers.
Slip: the mask rows for the new queries are sliced from the top ([:s]) instead of the bottom ([-s:]): a decoded token sees only key 0.
The full forward pass and the prompt pass are exact.
"""

import math
from types import SimpleNamespace

import torch
from torch import nn
from torch.nn import LayerNorm

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": [
        "transformer.layers.0.attention",
        "transformer.layers.1.attention",
        "transformer.layers.2.attention",
    ],
    "kind": "causal-multihead",
    "cache": "book-buffers",
    "decode": {
        "mistake": "cache_mask",
        "step": 0,
        "layer": "transformer.layers.0.attention",
    },
    "style": "the mask rows for the new queries are sliced from the top ([:s]) instead of the bottom "
    "([-s:]): a decoded token sees only key 0",
}


def gelu(x):
    return (
        0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * x * (1.0 + 0.044715 * x * x)))
    )


class DalleSelfAttention(nn.Module):
    """Fused query_key_value, multiplicative left-to-right mask, dense output.

    On cached calls it receives the whole (b, T, h) stream, projects only the rows after the cached
    ones, concatenates the cached per-head keys and values, and returns the whole (b, T, h) output
    (cached output rows first), as rudalle/dalle/transformer.py does.
    """

    def __init__(self, hidden_size, num_attention_heads, cogview_pb_relax=False):
        super().__init__()
        self.cogview_pb_relax = cogview_pb_relax
        self.hidden_size = hidden_size
        self.num_attention_heads = num_attention_heads
        self.hidden_size_per_attention_head = hidden_size // num_attention_heads
        self.query_key_value = nn.Linear(hidden_size, 3 * hidden_size)
        self.dense = nn.Linear(hidden_size, hidden_size)

    def _transpose_for_scores(self, tensor):
        shape = tensor.size()[:-1] + (
            self.num_attention_heads,
            self.hidden_size_per_attention_head,
        )
        return tensor.view(*shape).permute(0, 2, 1, 3)

    def _calculate_attention_scores(self, query_layer, key_layer, ltor_mask):
        key_t = key_layer.transpose(-1, -2)
        if self.cogview_pb_relax:
            attention_scores = torch.matmul(
                query_layer / math.sqrt(self.hidden_size_per_attention_head), key_t
            )
        else:
            attention_scores = torch.matmul(query_layer, key_t) / math.sqrt(
                self.hidden_size_per_attention_head
            )
        ltor_mask = ltor_mask[:, :, : attention_scores.shape[-2]]
        attention_scores = torch.mul(attention_scores, ltor_mask) - 10000.0 * (
            1.0 - ltor_mask
        )
        if self.cogview_pb_relax:
            # CogView PB-relax: subtract each (sample, head) maximum; softmax is unchanged
            alpha = 32
            scaled = attention_scores / alpha
            maxes = (
                scaled.detach()
                .reshape(scaled.size(0), scaled.size(1), -1)
                .max(dim=-1)[0]
            )
            attention_scores = (scaled - maxes[..., None, None]) * alpha
        return attention_scores

    def forward(self, hidden_states, ltor_mask, use_cache=False, cache=None):
        if use_cache and cache is not None:
            mixed_x_layer = self.query_key_value(
                hidden_states[:, cache[0].shape[-2] :, :]
            )
        else:
            mixed_x_layer = self.query_key_value(hidden_states)
        mixed_query_layer, mixed_key_layer, mixed_value_layer = torch.chunk(
            mixed_x_layer, 3, dim=-1
        )
        query_layer = self._transpose_for_scores(mixed_query_layer)
        key_layer = self._transpose_for_scores(mixed_key_layer)
        value_layer = self._transpose_for_scores(mixed_value_layer)
        if use_cache and cache is not None:
            past_key, past_value, past_output = cache
            key_layer = torch.cat((past_key, key_layer), dim=-2)
            value_layer = torch.cat((past_value, value_layer), dim=-2)
        attention_scores = self._calculate_attention_scores(
            query_layer, key_layer, ltor_mask
        )
        attention_probs = torch.softmax(attention_scores, dim=-1)
        context_layer = torch.matmul(attention_probs, value_layer)
        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        context_layer = context_layer.view(*context_layer.size()[:-2], self.hidden_size)
        output = self.dense(context_layer)
        if use_cache and cache is not None:
            output = torch.cat((past_output, output), dim=-2)
        if use_cache:
            cache = key_layer, value_layer, output
        return output, cache


ATTENTION_CLASSES = {"dalle": DalleSelfAttention}


class DalleMLP(nn.Module):
    def __init__(self, hidden_size):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(hidden_size, 4 * hidden_size)
        self.dense_4h_to_h = nn.Linear(4 * hidden_size, hidden_size)

    def forward(self, hidden_states):
        return self.dense_4h_to_h(gelu(self.dense_h_to_4h(hidden_states)))


class DalleTransformerLayer(nn.Module):
    """Pre-norm layer; with cogview_sandwich_layernorm the attention and MLP outputs are normed
    again before each residual addition."""

    def __init__(self, hidden_size, heads, eps, sandwich, pb_relax, attention="dalle"):
        super().__init__()
        self.cogview_sandwich_layernorm = sandwich
        self.input_layernorm = LayerNorm(hidden_size, eps=eps)
        if sandwich:
            self.before_first_addition_layernorm = LayerNorm(hidden_size, eps=eps)
            self.before_second_addition_layernorm = LayerNorm(hidden_size, eps=eps)
        self.attention = ATTENTION_CLASSES[attention](
            hidden_size, heads, cogview_pb_relax=pb_relax
        )
        self.post_attention_layernorm = LayerNorm(hidden_size, eps=eps)
        self.mlp = DalleMLP(hidden_size)

    def forward(self, hidden_states, ltor_mask, cache=None, use_cache=False):
        layernorm_output = self.input_layernorm(hidden_states)
        attention_output, new_cache = self.attention(
            layernorm_output, ltor_mask, use_cache=use_cache, cache=cache
        )
        if self.cogview_sandwich_layernorm:
            attention_output = self.before_first_addition_layernorm(attention_output)
        layernorm_input = hidden_states + attention_output
        cached = 0 if cache is None else cache[0].shape[-2]
        layernorm_output = self.post_attention_layernorm(layernorm_input)
        if use_cache and cached:
            # rows already cached are not run through the MLP again (they are not read later)
            mlp_output = torch.cat(
                (
                    layernorm_output[..., :cached, :],
                    self.mlp(layernorm_output[..., cached:, :]),
                ),
                dim=-2,
            )
        else:
            mlp_output = self.mlp(layernorm_output)
        if self.cogview_sandwich_layernorm:
            mlp_output = self.before_second_addition_layernorm(mlp_output)
        return layernorm_input + mlp_output, new_cache


class DalleTransformer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_layers = config.num_layers
        self.layers = nn.ModuleList(
            [
                DalleTransformerLayer(
                    config.hidden_size,
                    config.num_attention_heads,
                    config.layernorm_epsilon,
                    config.cogview_sandwich_layernorm,
                    config.cogview_pb_relax,
                    config.attention[i],
                )
                for i in range(config.num_layers)
            ]
        )
        self.final_layernorm = LayerNorm(
            config.hidden_size, eps=config.layernorm_epsilon
        )

    def forward(self, hidden_states, attention_mask, cache=None, use_cache=False):
        if cache is None:
            cache = {}
        for i, layer in enumerate(self.layers):
            hidden_states, layer_cache = layer(
                hidden_states, attention_mask, cache.get(i), use_cache=use_cache
            )
            cache[i] = layer_cache
        return self.final_layernorm(hidden_states), cache


class DalleModel(nn.Module):
    """ruDALL-E's text stream as a causal LM: text_embeddings + text_pos_embeddings, the
    DalleTransformer, to_logits.

    rudalle's generation loop hands the whole id sequence and the cache dict to every call; here the
    model keeps both (book buffers): reset_kv_cache(), then model(ids, use_cache=True) appends the
    ids to the kept ones, runs the whole sequence with the cache and returns the new rows' logits.
    """

    def __init__(self, config):
        super().__init__()
        self.text_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.text_pos_embeddings = nn.Embedding(
            config.max_positions, config.hidden_size
        )
        self.transformer = DalleTransformer(config)
        self.to_logits = nn.Sequential(
            LayerNorm(config.hidden_size, eps=config.layernorm_epsilon),
            nn.Linear(config.hidden_size, config.vocab_size),
        )
        self._cache = None
        self._ids = None

    def reset_kv_cache(self):
        self._cache = None
        self._ids = None

    def _run(self, input_ids, cache, use_cache):
        s = input_ids.shape[1]
        positions = torch.arange(s, device=input_ids.device)
        h = self.text_embeddings(input_ids) + self.text_pos_embeddings(positions)[None]
        attention_mask = torch.tril(
            torch.ones(1, 1, s, s, dtype=h.dtype, device=h.device)
        )
        h, cache = self.transformer(h, attention_mask, cache=cache, use_cache=use_cache)
        return self.to_logits(h), cache

    def forward(self, input_ids, use_cache=False):
        if not use_cache:
            return self._run(input_ids, None, False)[0]
        ids = (
            input_ids if self._ids is None else torch.cat([self._ids, input_ids], dim=1)
        )
        logits, self._cache = self._run(ids, self._cache, True)
        self._ids = ids
        return logits[:, -input_ids.shape[1] :]


def make_model():
    torch.manual_seed(3411)

    config = SimpleNamespace(
        vocab_size=96,
        hidden_size=64,
        num_attention_heads=4,
        num_layers=3,
        max_positions=64,
        layernorm_epsilon=1e-5,
        cogview_sandwich_layernorm=True,
        cogview_pb_relax=False,
        attention=["dalle", "dalle", "dalle"],
    )
    model = DalleModel(config)
    g = torch.Generator().manual_seed(34111)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
        model.text_pos_embeddings.weight.normal_(0.0, 1.0, generator=g)
    return model.eval()

"""Pax/Praxis TransformerLm (praxis/layers/transformer_models.py + transformers.py + attentions.py)
ported to PyTorch module by module, keeping Praxis' names and weight layouts.

softmax (SharedEmbeddingSoftmax: logits_ffn.linear.w (D, V) and bias.b; the embedding lookup reads
the transposed softmax weight and multiplies by sqrt(D)), transformer (StackedTransformer:
x_layers.N = Transformer with layer_norm, self_attention, ff_layer), final_ln.  Praxis LayerNorm
multiplies by (1 + scale) and adds bias.  DotProductAttention: `query`/`key`/`value` are
AttentionProjection layers holding w (D, N, H) and b (N, H) applied with einsum 'BTD,DNH->BTNH',
`post` is an output AttentionProjection (w (D, N, H), b (D,)) applied with 'BTNH,DNH->BTD'.
RotaryPositionalEmbedding (min_timescale 1, max_timescale 1e4) rotates the two halves of each head
(first_half * cos - second_half * sin ...).  _scale_query multiplies q by 1/sqrt(dim_per_head)
(per_dim_scale off), logits 'BTNH,BSNH->BNTS', causal mask applied with
jnp.where(mask, logits, large_negative) where large_negative = -0.7 * finfo.max, softmax,
'BNTS,BSNH->BTNH'.  MHA 4 x 16, relu FFN (ffn_layer1/ffn_layer2 with their own layer_norm).
Cache: book-cache.  Praxis' extend_step keeps decoder_cache key_state / value_state as (B, T, N, H);
here they live in an external cache object: `cache = mod.KVCache(n_layers=3)` (`get(i)`,
`update(i, (k, v))`, `seq_len()`), `model(prompt, cache=cache)`, `model(tok, cache=cache)`; entries are
(b, s, n, h), grown on dim 1; the time step is `cache.seq_len()` read once per call.
`model.reset_kv_cache()` is a no-op.  Returns the logits tensor (every position).  Correct.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": [
        "transformer.x_layers.0.self_attention",
        "transformer.x_layers.1.self_attention",
        "transformer.x_layers.2.self_attention",
    ],
    "kind": "causal-multihead",
    "cache": "book-cache",
    "style": "Praxis TransformerLm ported: AttentionProjection w (D, N, H) einsums, (1 + scale) LayerNorm, "
    "half-split RotaryPositionalEmbedding, _scale_query, where(mask, logits, -0.7*max), shared "
    "embedding-softmax x sqrt(D); external KVCache standing in for extend_step's decoder_cache",
}


class KVCache:
    def __init__(self, n_layers):
        self.cache = [None] * n_layers

    def get(self, layer_idx):
        return self.cache[layer_idx]

    def update(self, layer_idx, value):
        self.cache[layer_idx] = value

    def seq_len(self):
        return 0 if self.cache[0] is None else self.cache[0][0].shape[1]

    def reset(self):
        for i in range(len(self.cache)):
            self.cache[i] = None


class LayerNorm(nn.Module):
    def __init__(self, dim, epsilon=1e-6):
        super().__init__()
        self.epsilon = epsilon
        self.scale = nn.Parameter(torch.zeros(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, inputs):
        mean = inputs.mean(-1, keepdim=True)
        var = ((inputs - mean) ** 2).mean(-1, keepdim=True)
        normed = (inputs - mean) * torch.rsqrt(var + self.epsilon)
        return normed * (1 + self.scale) + self.bias


class AttentionProjection(nn.Module):
    def __init__(self, input_dim, num_heads, dim_per_head, is_output_projection=False):
        super().__init__()
        self.is_output_projection = is_output_projection
        self.w = nn.Parameter(torch.randn(input_dim, num_heads, dim_per_head) / math.sqrt(input_dim))
        if is_output_projection:
            self.b = nn.Parameter(0.02 * torch.randn(input_dim))
        else:
            self.b = nn.Parameter(0.02 * torch.randn(num_heads, dim_per_head))

    def forward(self, inputs):
        if self.is_output_projection:
            return torch.einsum("BTNH,DNH->BTD", inputs, self.w) + self.b
        return torch.einsum("BTD,DNH->BTNH", inputs, self.w) + self.b


class RotaryPositionalEmbedding(nn.Module):
    def __init__(self, embedding_dims, min_timescale=1, max_timescale=10000):
        super().__init__()
        self.embedding_dims = embedding_dims
        self.min_timescale = min_timescale
        self.max_timescale = max_timescale

    def forward(self, inputs, position):
        # inputs (B, T, N, H); position (B, T)
        half = self.embedding_dims // 2
        fraction = 2 * torch.arange(0, half, dtype=torch.float64) / self.embedding_dims
        timescale = self.min_timescale * (self.max_timescale / self.min_timescale) ** fraction
        sinusoid_inp = position[:, :, None].to(torch.float64) / timescale[None, None, :]
        sin = torch.sin(sinusoid_inp)[:, :, None, :].to(inputs.dtype)
        cos = torch.cos(sinusoid_inp)[:, :, None, :].to(inputs.dtype)
        first_half, second_half = torch.split(inputs, half, dim=-1)
        first_part = first_half * cos - second_half * sin
        second_part = second_half * cos + first_half * sin
        return torch.cat([first_part, second_part], dim=-1)


class DotProductAttention(nn.Module):
    def __init__(self, input_dim, hidden_dim, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.dim_per_head = hidden_dim // num_heads
        self.query = AttentionProjection(input_dim, num_heads, self.dim_per_head)
        self.key = AttentionProjection(input_dim, num_heads, self.dim_per_head)
        self.value = AttentionProjection(input_dim, num_heads, self.dim_per_head)
        self.post = AttentionProjection(input_dim, num_heads, self.dim_per_head, is_output_projection=True)
        self.rotary_position_emb = RotaryPositionalEmbedding(self.dim_per_head)

    def _scale_query(self, query):
        return query * (1.0 / math.sqrt(self.dim_per_head))

    def _dot_atten(self, query, key, value, atten_mask):
        query = self._scale_query(query)
        logits = torch.einsum("BTNH,BSNH->BNTS", query, key)
        large_negative = -0.7 * torch.finfo(logits.dtype).max
        logits = torch.where(atten_mask, logits, torch.full_like(logits, large_negative))
        probs = F.softmax(logits, dim=-1)
        return torch.einsum("BNTS,BSNH->BTNH", probs, value)

    def forward(self, query_vec, segment_pos, atten_mask, layer_cache=None):
        query_proj = self.query(query_vec)
        key_proj = self.key(query_vec)
        value_proj = self.value(query_vec)
        query_proj = self.rotary_position_emb(query_proj, segment_pos)
        key_proj = self.rotary_position_emb(key_proj, segment_pos)
        if layer_cache is not None:
            # extend_step: decoder_cache key_state / value_state extended along T
            cached_k, cached_v = layer_cache
            key_proj = torch.cat([cached_k, key_proj], dim=1)
            value_proj = torch.cat([cached_v, value_proj], dim=1)
        encoded = self._dot_atten(query_proj, key_proj, value_proj, atten_mask)
        return self.post(encoded), (key_proj, value_proj)


class TransformerFeedForward(nn.Module):
    def __init__(self, input_dims, hidden_dims):
        super().__init__()
        self.layer_norm = LayerNorm(input_dims)
        self.ffn_layer1 = nn.Linear(input_dims, hidden_dims)
        self.ffn_layer2 = nn.Linear(hidden_dims, input_dims)

    def forward(self, inputs):
        return inputs + self.ffn_layer2(F.relu(self.ffn_layer1(self.layer_norm(inputs))))


class Transformer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layer_norm = LayerNorm(config.model_dims)
        self.self_attention = DotProductAttention(config.model_dims, config.model_dims, config.num_heads)
        self.ff_layer = TransformerFeedForward(config.model_dims, config.hidden_dims)

    def forward(self, inputs, segment_pos, atten_mask, layer_cache=None):
        atten_output, new_cache = self.self_attention(self.layer_norm(inputs), segment_pos, atten_mask, layer_cache)
        return self.ff_layer(inputs + atten_output), new_cache


class StackedTransformer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.x_layers = nn.ModuleList([Transformer(config) for _ in range(config.num_layers)])


class Linear(nn.Module):
    def __init__(self, input_dims, output_dims):
        super().__init__()
        self.w = nn.Parameter(torch.randn(input_dims, output_dims) / math.sqrt(input_dims))


class Bias(nn.Module):
    def __init__(self, dims):
        super().__init__()
        self.b = nn.Parameter(torch.zeros(dims))


class FeedForwardLogits(nn.Module):
    def __init__(self, input_dims, output_dims):
        super().__init__()
        self.linear = Linear(input_dims, output_dims)
        self.bias = Bias(output_dims)


class SharedEmbeddingSoftmax(nn.Module):
    def __init__(self, input_dims, num_classes):
        super().__init__()
        self.input_dims = input_dims
        self.logits_ffn = FeedForwardLogits(input_dims, num_classes)

    def emb_lookup(self, ids):
        embs = self.logits_ffn.linear.w.t()[ids]
        return embs * math.sqrt(self.input_dims)

    def get_logits(self, inputs):
        return inputs @ self.logits_ffn.linear.w + self.logits_ffn.bias.b


class TransformerLm(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.softmax = SharedEmbeddingSoftmax(config.model_dims, config.vocab_size)
        self.transformer = StackedTransformer(config)
        self.final_ln = LayerNorm(config.model_dims)

    def reset_kv_cache(self):
        pass

    def forward(self, ids, cache=None):
        b, t = ids.shape
        time_step = cache.seq_len() if cache is not None else 0
        x = self.softmax.emb_lookup(ids)
        segment_pos = torch.arange(time_step, time_step + t, device=ids.device)[None, :].expand(b, -1)
        q_pos = torch.arange(time_step, time_step + t, device=ids.device)
        k_pos = torch.arange(0, time_step + t, device=ids.device)
        atten_mask = (k_pos[None, :] <= q_pos[:, None])[None, None]
        for i, layer in enumerate(self.transformer.x_layers):
            layer_cache = cache.get(i) if cache is not None else None
            x, new_cache = layer(x, segment_pos, atten_mask, layer_cache)
            if cache is not None:
                cache.update(i, new_cache)
        return self.softmax.get_logits(self.final_ln(x))


def make_model():
    torch.manual_seed(1904)
    config = SimpleNamespace(vocab_size=96, model_dims=64, hidden_dims=128, num_heads=4, num_layers=3)
    model = TransformerLm(config)
    g = torch.Generator().manual_seed(19041)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LayerNorm):
                m.scale.copy_(0.3 * torch.randn(m.scale.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
        model.softmax.logits_ffn.linear.w.mul_(0.2)
    return model.eval()

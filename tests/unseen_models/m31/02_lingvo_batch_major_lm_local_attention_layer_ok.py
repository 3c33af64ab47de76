"""Lingvo's batch-major Transformer LM (lingvo/core/batch_major_attention.py), ported to torch
module by module and driven by token ids.

Tree: emb (EmbeddingLayer `wm`, times sqrt(model_dim)), position_emb (sinusoids, sin block then cos
block, made in float64 and cast), stack (StackedTransformerLayers: x_layers.N = TransformerLayer
with
self_atten (TransformerAttentionLayer: pre layer_norm, atten, residual) and fflayer; final_ln),
softmax (SimpleFullSoftmax weight_0/bias_0).  LayerNorms apply (1 + scale).  Attention
(`stack.x_layers.N.self_atten.atten`): MultiHeadedProjectionLayer query/key/value with w (D, N, H)
and bias (N, H), einsum 'BTD,DNH->BTNH'; 4 heads of 16; layers 0 and 2 are MultiHeadedAttention
(causal); layer 1 is LocalSelfAttention with left_context 6 (the current step and 5 before it:
sliding_window 6); query multiplied by
dim_per_head**-0.5 before 'BTNH,BSNH->BNTS'; hidden keys set to GetDtypeMin (-0.7 * finfo.max) with
a where; softmax; 'BNTS,BSNH->BTNH'; post projection 'BTNH,DNH->BTD' plus bias (D,).
Cache ("book-cache"): `cache = mod.KVCache(n_layers=N)`, `model(prompt, cache=cache)`, then
`model(tok, cache=cache)`.  The first call fills `cache.states` with each layer's
InitStates(batch, 64): time-major (T, B, N, H) key/value tensors in the activations' dtype.
ExtendStep writes the new steps at rows time_step.. and attends over all 64 rows with a
per-step padding (later rows, and rows outside a local layer's left context, hidden).
`cache.time_step` counts the cached steps; more than 64 or a changed batch raise ValueError.
`model.reset_kv_cache()` does nothing.  Returns logits (b, s, 96).
No slip."""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": [
        "stack.x_layers.0.self_atten.atten",
        "stack.x_layers.1.self_atten.atten",
        "stack.x_layers.2.self_atten.atten",
    ],
    "kind": "causal-multihead",
    "cache": "book-cache",
    "style": "Lingvo batch-major LM: (D, N, H) projection weights with biases, sinusoidal absolute "
    "positions, (1 + scale) LayerNorms, query pre-scaled, -0.7*max padding fill, layer 1 "
    "local window 6, time-major InitStates/ExtendStep states",
}


def _dtype_min(dtype):
    # lingvo's py_utils.GetDtypeMin for floats: a large negative that stays finite.
    return -0.7 * torch.finfo(dtype).max


class LayerNorm(nn.Module):
    """lingvo layers.LayerNorm: the learned `scale` is applied as (1 + scale)."""

    def __init__(self, input_dim, epsilon=1e-6):
        super().__init__()
        self.epsilon = epsilon
        self.scale = nn.Parameter(torch.zeros(input_dim))
        self.bias = nn.Parameter(torch.zeros(input_dim))

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        var = (x - mean).pow(2).mean(-1, keepdim=True)
        return (x - mean) * torch.rsqrt(var + self.epsilon) * (1.0 + self.scale) + self.bias


class MultiHeadedProjectionLayer(nn.Module):
    """Weights kept in lingvo's (model_dim, num_heads, dim_per_head) layout."""

    def __init__(self, input_dim, num_heads, dim_per_head, is_output_projection=False):
        super().__init__()
        self.is_output_projection = is_output_projection
        self.w = nn.Parameter(
            torch.randn(input_dim, num_heads, dim_per_head) / math.sqrt(input_dim)
        )
        bias_shape = (input_dim,) if is_output_projection else (num_heads, dim_per_head)
        self.b = nn.Parameter(0.1 * torch.randn(bias_shape))

    def forward(self, inputs):
        if self.is_output_projection:
            return torch.einsum("BTNH,DNH->BTD", inputs, self.w) + self.b
        return torch.einsum("BTD,DNH->BTNH", inputs, self.w) + self.b


class MultiHeadedAttention(nn.Module):
    """batch_major_attention.MultiHeadedAttention (left_context=None) or LocalSelfAttention.

    `left_context` counts the current step, so a local layer sees `left_context` keys; the port
    records the same number as `sliding_window`.
    """

    def __init__(self, p):
        super().__init__()
        self.input_dim = p.input_dim
        self.hidden_dim = p.hidden_dim
        self.num_heads = p.num_heads
        self.dim_per_head = p.hidden_dim // p.num_heads
        self.left_context = p.left_context
        self.sliding_window = p.left_context
        self.mask_left_context = p.mask_left_context
        self.scale_dim = p.scale_dim
        self.one_step_value_from_key = p.one_step_value_from_key
        self.query = MultiHeadedProjectionLayer(p.input_dim, p.num_heads, self.dim_per_head)
        self.key = MultiHeadedProjectionLayer(p.input_dim, p.num_heads, self.dim_per_head)
        self.value = MultiHeadedProjectionLayer(p.input_dim, p.num_heads, self.dim_per_head)
        self.post = MultiHeadedProjectionLayer(
            p.input_dim, p.num_heads, self.dim_per_head, is_output_projection=True
        )

    def InitStates(self, target_batch_size, target_max_length, dtype, device):
        shape = (target_max_length, target_batch_size, self.num_heads, self.dim_per_head)
        return SimpleNamespace(
            key=torch.zeros(shape, dtype=dtype, device=device),
            value=torch.zeros(shape, dtype=dtype, device=device),
        )

    def _Padding(self, query_steps, key_steps):
        # True where the key is hidden from the query.
        gap = query_steps[:, None] - key_steps[None, :]
        padding = gap < 0
        if self.left_context is not None and self.mask_left_context:
            padding = padding | (gap >= self.left_context)
        return padding

    def _DotAtten(self, query, key, value, padding):
        # query (B, T, N, H); key, value (B, S, N, H); padding (T, S)
        query = query * (self.scale_dim**-0.5)
        logits = torch.einsum("BTNH,BSNH->BNTS", query, key)
        logits = torch.where(padding[None, None], _dtype_min(logits.dtype), logits)
        probs = torch.softmax(logits, dim=-1)
        return torch.einsum("BNTS,BSNH->BTNH", probs, value)

    def forward(self, query_vec, cached_states=None, time_step=0):
        """FProp over the whole (causal) sequence; with states, ExtendStep."""
        if cached_states is not None:
            return self.ExtendStep(query_vec, cached_states, time_step)
        q = self.query(query_vec)
        k = self.key(query_vec)
        v = self.value(query_vec)
        steps = torch.arange(query_vec.shape[1], device=query_vec.device)
        encoded = self._DotAtten(q, k, v, self._Padding(steps, steps))
        return self.post(encoded)

    def ExtendStep(self, query_vec, cached_states, time_step):
        """Extends the time-major (T, B, N, H) key/value states by the new steps and attends."""
        seq = query_vec.shape[1]
        q = self.query(query_vec)
        k = self.key(query_vec)
        v = self.value(query_vec)
        rows = slice(time_step, time_step + seq)
        cached_states.key[rows] = k.transpose(0, 1)
        if seq == 1 and time_step > 0 and self.one_step_value_from_key:
            cached_states.value[rows] = k.transpose(0, 1)
        else:
            cached_states.value[rows] = v.transpose(0, 1)
        keys = cached_states.key.transpose(0, 1)
        values = cached_states.value.transpose(0, 1)
        device = query_vec.device
        query_steps = torch.arange(time_step, time_step + seq, device=device)
        key_steps = torch.arange(keys.shape[1], device=device)
        encoded = self._DotAtten(q, keys, values, self._Padding(query_steps, key_steps))
        return self.post(encoded)


class TransformerAttentionLayer(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.layer_norm = LayerNorm(p.input_dim)
        self.atten = MultiHeadedAttention(p)

    def forward(self, query_vec, cached_states=None, time_step=0):
        normed = self.layer_norm(query_vec)
        return query_vec + self.atten(normed, cached_states, time_step)


class TransformerFeedForwardLayer(nn.Module):
    def __init__(self, input_dim, hidden_dim):
        super().__init__()
        self.layer_norm = LayerNorm(input_dim)
        self.fflayer = nn.Sequential(
            nn.Linear(input_dim, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, input_dim)
        )

    def forward(self, x):
        return x + self.fflayer(self.layer_norm(x))


class TransformerLayer(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.self_atten = TransformerAttentionLayer(p)
        self.fflayer = TransformerFeedForwardLayer(p.input_dim, p.ff_hidden_dim)

    def forward(self, x, cached_states=None, time_step=0):
        return self.fflayer(self.self_atten(x, cached_states, time_step))


class StackedTransformerLayers(nn.Module):
    def __init__(self, layer_params, input_dim):
        super().__init__()
        self.x_layers = nn.ModuleList(TransformerLayer(p) for p in layer_params)
        self.final_ln = LayerNorm(input_dim)


class PositionalEmbeddingLayer(nn.Module):
    """Sinusoids (sin block, then cos block), made in float64 and cast."""

    def __init__(self, embedding_dim, min_timescale=1.0, max_timescale=1.0e4):
        super().__init__()
        self.embedding_dim = embedding_dim
        self.min_timescale = min_timescale
        self.max_timescale = max_timescale

    def FPropWithPosition(self, positions, dtype):
        num_timescales = self.embedding_dim // 2
        increment = math.log(self.max_timescale / self.min_timescale) / max(num_timescales - 1, 1)
        steps = torch.arange(num_timescales, dtype=torch.float64, device=positions.device)
        inv_timescales = self.min_timescale * torch.exp(steps * -increment)
        scaled = positions.to(torch.float64)[:, None] * inv_timescales[None, :]
        return torch.cat((scaled.sin(), scaled.cos()), dim=-1).to(dtype)


class EmbeddingLayer(nn.Module):
    def __init__(self, vocab_size, embedding_dim):
        super().__init__()
        self.wm = nn.Parameter(torch.randn(vocab_size, embedding_dim) / math.sqrt(embedding_dim))
        self.scale = math.sqrt(embedding_dim)

    def forward(self, ids):
        return F.embedding(ids, self.wm) * self.scale


class SimpleFullSoftmax(nn.Module):
    def __init__(self, input_dim, num_classes):
        super().__init__()
        self.weight_0 = nn.Parameter(torch.randn(input_dim, num_classes) / math.sqrt(input_dim))
        self.bias_0 = nn.Parameter(torch.zeros(num_classes))

    def forward(self, x):
        return x @ self.weight_0 + self.bias_0


class KVCache:
    """The decoder's prefix states: one lingvo NestedMap (key, value; time-major) per layer."""

    def __init__(self, n_layers, max_sequence_length=64):
        self.n_layers = n_layers
        self.max_sequence_length = max_sequence_length
        self.states = None
        self.batch_size = None
        self.time_step = 0

    def get_seq_length(self):
        return self.time_step


class TransformerBatchMajorLm(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.emb = EmbeddingLayer(config.vocab_size, config.model_dim)
        self.position_emb = PositionalEmbeddingLayer(config.model_dim)
        layer_params = []
        for i in range(config.num_layers):
            layer_params.append(
                SimpleNamespace(
                    input_dim=config.model_dim,
                    hidden_dim=config.model_dim,
                    num_heads=config.num_heads,
                    ff_hidden_dim=config.ff_hidden_dim,
                    left_context=config.left_context if i in config.local_layers else None,
                    mask_left_context=i not in config.unmasked_local_layers,
                    scale_dim=config.model_dim
                    if i in config.hidden_dim_scale_layers
                    else config.model_dim // config.num_heads,
                    one_step_value_from_key=config.one_step_value_from_key,
                )
            )
        self.stack = StackedTransformerLayers(layer_params, config.model_dim)
        self.softmax = SimpleFullSoftmax(config.model_dim, config.vocab_size)
        self.positions_restart_per_call = config.positions_restart_per_call

    def reset_kv_cache(self):
        """Nothing to do: the states live in the KVCache object handed to forward."""

    def forward(self, ids, cache=None):
        bsz, seq = ids.shape
        start = 0
        if cache is not None:
            if cache.states is None:
                cache.states = [
                    layer.self_atten.atten.InitStates(
                        bsz,
                        cache.max_sequence_length,
                        self.emb.wm.dtype,
                        ids.device,
                    )
                    for layer in self.stack.x_layers
                ]
                cache.batch_size = bsz
            if bsz != cache.batch_size:
                raise ValueError(f"cache made for batch {cache.batch_size}, got {bsz}")
            if cache.time_step + seq > cache.max_sequence_length:
                raise ValueError("sequence longer than the cache")
            start = cache.time_step
        first_position = 0 if self.positions_restart_per_call else start
        positions = torch.arange(first_position, first_position + seq, device=ids.device)
        x = self.emb(ids)
        x = x + self.position_emb.FPropWithPosition(positions, x.dtype)[None]
        for i, layer in enumerate(self.stack.x_layers):
            states = cache.states[i] if cache is not None else None
            x = layer(x, states, start)
        if cache is not None:
            cache.time_step += seq
        return self.softmax(self.stack.final_ln(x))


def make_model():
    torch.manual_seed(3102)
    config = SimpleNamespace(
        vocab_size=96,
        model_dim=64,
        num_heads=4,
        ff_hidden_dim=128,
        left_context=6,
        num_layers=3,
        local_layers=(1,),
        unmasked_local_layers=(),
        hidden_dim_scale_layers=(),
        positions_restart_per_call=False,
        one_step_value_from_key=False,
    )
    model = TransformerBatchMajorLm(config)
    g = torch.Generator().manual_seed(31021)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LayerNorm):
                m.scale.copy_(0.3 * torch.randn(m.scale.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model.eval()

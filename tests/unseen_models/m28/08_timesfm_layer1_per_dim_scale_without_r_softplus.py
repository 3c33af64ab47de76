"""TimesFM's PyTorch patched decoder (pytorch_patched_decoder.py) driven by token ids.

After google-research/timesfm and transformers' modeling_timesfm.py; token ids replace the patches.

PatchedTimeSeriesDecoder: input_ff_layer (an embedding here, the residual patch MLP in TimesFM)
plus the Pax sinusoid ([sin | cos] halves, timescales 1..1e4, offset by the cache position),
stacked_transformer (StackedDecoder: layers.N = TimesFmDecoderLayer: input_layernorm RMSNorm ->
self_attn -> + residual -> TimesFmMLP, which carries its own LayerNorm and residual),
horizon_ff_layer as the output head.

TimesFmAttention: fused qkv_proj split [q_size, kv_size, kv_size], 4 kv heads for 4 query heads
(repeat_interleave, as gemma_pytorch), no rotary, and the Pax per-dim query scaling: query *
softplus(scaling) * r_softplus_0 / sqrt(head_dim) with `scaling` at zero and r_softplus_0 =
1.442695041 = 1 / softplus(0), so the scale is 1 / sqrt(head_dim). Additive finfo.min mask.

Cache (book-cache): `cache = mod.KVCache(n_layers=3)`, `model(prompt, cache=cache)`, then
`model(tok, cache=cache)`; gemma_pytorch-style pre-allocated (batch, 64, kv_heads, head_dim) slabs
written with index_copy_ at kv_write_indices; every slab slot is a key column, the mask hides
unwritten ones. Returns the logits tensor.

Slip: MHA 4/4, 3 layers; layer 1 gets r_softplus_0 = 1.0 (the constant left out of a port): its
queries are scaled by softplus(0) / sqrt(16) = 0.1733 instead of 0.25. Cached decoding agrees with
its own full pass.
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
        "stacked_transformer.layers.0.self_attn",
        "stacked_transformer.layers.1.self_attn",
        "stacked_transformer.layers.2.self_attn",
    ],
    "kind": "causal-multihead",
    "cache": "book-cache",
    "layer": "stacked_transformer.layers.1.self_attn",
    "stage": "scaled_scores",
    "mistake": "wrong_scale",
    "style": "TimesFM as 01 with MHA 4/4; layer 1's per-dim query scale lacks the "
    "1.442695041 constant: factor ln2/4 instead of 1/4",
}


class TimesFmRMSNorm(nn.Module):
    """Pax RMS norm: scales only, accumulates in at least float32."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        acc = hidden_states.to(torch.promote_types(hidden_states.dtype, torch.float32))
        variance = acc.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class TimesFmPositionalEmbedding(nn.Module):
    """Pax sinusoid: [sin | cos] halves over geometric timescales, built in float64 at call time."""

    def __init__(self, embedding_dims, min_timescale=1.0, max_timescale=10000.0):
        super().__init__()
        self.embedding_dims = embedding_dims
        self.min_timescale = min_timescale
        self.max_timescale = max_timescale

    def forward(self, seq_length=None, position=None, dtype=torch.float32, device=None):
        if position is None:
            position = torch.arange(seq_length, dtype=torch.float64, device=device)[None]
        position = position.to(torch.float64)
        num_timescales = self.embedding_dims // 2
        log_inc = math.log(self.max_timescale / self.min_timescale) / max(num_timescales - 1, 1)
        inv_timescales = self.min_timescale * torch.exp(
            torch.arange(num_timescales, dtype=torch.float64, device=device) * -log_inc
        )
        scaled_time = position[..., None] * inv_timescales[None, None, :]
        return torch.cat([torch.sin(scaled_time), torch.cos(scaled_time)], dim=-1).to(dtype)


class KVCache:
    """gemma_pytorch-style pre-allocated caches, one (k_cache, v_cache) slab pair per layer.

    Slabs are (batch, max_len, kv_heads, head_dim) in the activations' dtype, created at the
    first call that writes them; `kv_write_indices` are written with index_copy_.
    """

    def __init__(self, n_layers, max_len=64):
        self.n_layers = n_layers
        self.max_len = max_len
        self.slabs = [None] * n_layers
        self.seen = 0

    def get_seq_length(self):
        return self.seen

    def slab(self, idx, like, kv_heads, head_dim):
        if self.slabs[idx] is None:
            shape = (like.shape[0], self.max_len, kv_heads, head_dim)
            self.slabs[idx] = (
                torch.zeros(shape, dtype=like.dtype, device=like.device),
                torch.zeros(shape, dtype=like.dtype, device=like.device),
            )
        return self.slabs[idx]

    def reset(self):
        self.slabs = [None] * self.n_layers
        self.seen = 0


class TimesFmAttention(nn.Module):
    """Fused qkv_proj split q / k / v, Pax per-dim query scaling, GQA by repeat_interleave."""

    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.num_queries_per_kv = self.num_heads // self.num_kv_heads
        self.hidden_size = config.hidden_size
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # r_softplus_0 of the Pax per-dim scale: softplus(0) * r_softplus_0 == 1
        self.r_softplus_0 = config.r_softplus_0[layer_idx]
        self.scaling = nn.Parameter(torch.zeros(self.head_dim))
        self.qkv_proj = nn.Linear(self.hidden_size, self.q_size + 2 * self.kv_size)
        self.o_proj = nn.Linear(self.q_size, self.hidden_size)

    def _per_dim_scaling(self, query):
        r_softplus_0 = self.r_softplus_0 / math.sqrt(self.head_dim)
        scale = F.softplus(self.scaling) * r_softplus_0
        return query * scale[None, None, None, :]

    def forward(self, hidden_states, mask, kv_write_indices=None, kv_cache=None):
        batch_size, input_len, _ = hidden_states.shape
        qkv = self.qkv_proj(hidden_states)
        xq, xk, xv = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        xq = xq.view(batch_size, -1, self.num_heads, self.head_dim)
        xk = xk.view(batch_size, -1, self.num_kv_heads, self.head_dim)
        xv = xv.view(batch_size, -1, self.num_kv_heads, self.head_dim)
        xq = self._per_dim_scaling(xq)
        if kv_cache is not None:
            k_cache, v_cache = kv_cache
            k_cache.index_copy_(1, kv_write_indices, xk)
            v_cache.index_copy_(1, kv_write_indices, xv)
            key, value = k_cache, v_cache
        else:
            key, value = xk, xv
        if self.num_kv_heads != self.num_heads:
            key = torch.repeat_interleave(key, self.num_queries_per_kv, dim=2)
            value = torch.repeat_interleave(value, self.num_queries_per_kv, dim=2)
        q = xq.transpose(1, 2)
        k = key.transpose(1, 2)
        v = value.transpose(1, 2)
        scores = torch.matmul(q, k.transpose(2, 3))
        scores = scores + mask
        scores = F.softmax(scores, dim=-1)
        output = torch.matmul(scores, v)
        output = output.transpose(1, 2).contiguous().view(batch_size, input_len, -1)
        return self.o_proj(output)


class TimesFmMLP(nn.Module):
    """Pax MLP: its own LayerNorm, gate_proj -> relu -> down_proj, residual inside."""

    def __init__(self, hidden_size, intermediate_size):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size)
        self.down_proj = nn.Linear(intermediate_size, hidden_size)
        self.layer_norm = nn.LayerNorm(hidden_size, eps=1e-6)

    def forward(self, x):
        return self.down_proj(F.relu(self.gate_proj(self.layer_norm(x)))) + x


class TimesFmDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = TimesFmAttention(config, layer_idx)
        self.mlp = TimesFmMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = TimesFmRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, mask, kv_write_indices=None, kv_cache=None):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = self.self_attn(hidden_states, mask, kv_write_indices, kv_cache)
        return self.mlp(residual + hidden_states)


class StackedDecoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList(
            [TimesFmDecoderLayer(config, i) for i in range(config.num_layers)]
        )

    def forward(self, hidden_states, mask, kv_write_indices=None, kv_caches=None):
        for i, layer in enumerate(self.layers):
            kv_cache = kv_caches[i] if kv_caches is not None else None
            hidden_states = layer(hidden_states, mask, kv_write_indices, kv_cache)
        return hidden_states


class PatchedTimeSeriesDecoder(nn.Module):
    """TimesFM's decoder stack over token ids: embedding + sinusoid, stacked_transformer, head."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.input_ff_layer = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_emb = TimesFmPositionalEmbedding(config.hidden_size)
        self.stacked_transformer = StackedDecoder(config)
        self.horizon_ff_layer = nn.Linear(config.hidden_size, config.vocab_size)

    def reset_kv_cache(self):
        pass

    def forward(self, input_ids, cache=None):
        bsz, seq_len = input_ids.shape
        device = input_ids.device
        hidden = self.input_ff_layer(input_ids)
        dtype = hidden.dtype
        start = cache.get_seq_length() if cache is not None else 0
        if cache is not None and start > 0 and not self.config.offset_positions_on_decode:
            pos_emb = self.position_emb(seq_length=seq_len, dtype=dtype, device=device)
        else:
            position = torch.arange(start, start + seq_len, device=device)[None]
            pos_emb = self.position_emb(position=position, dtype=dtype, device=device)
        hidden = hidden + pos_emb
        neg = torch.finfo(dtype).min
        q_pos = torch.arange(start, start + seq_len, device=device)
        if cache is None:
            k_pos = q_pos
            kv_caches = None
            kv_write_indices = None
        else:
            if start + seq_len > cache.max_len:
                raise ValueError("KVCache is full")
            k_pos = torch.arange(cache.max_len, device=device)
            kv_write_indices = q_pos
            kv_caches = [
                cache.slab(i, hidden, self.config.num_kv_heads, self.config.head_dim)
                for i in range(self.config.num_layers)
            ]
        allowed = k_pos[None, :] <= q_pos[:, None]
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, neg)
        hidden = self.stacked_transformer(hidden, mask[None, None], kv_write_indices, kv_caches)
        if cache is not None:
            cache.seen = start + seq_len
        return self.horizon_ff_layer(hidden)


def make_model():
    torch.manual_seed(2808)
    config = SimpleNamespace(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        head_dim=16,
        rms_norm_eps=1e-6,
        num_layers=3,
        num_heads=4,
        num_kv_heads=4,
        r_softplus_0=[1.442695041, 1.0, 1.442695041],
        offset_positions_on_decode=True,
    )
    model = PatchedTimeSeriesDecoder(config)
    g = torch.Generator().manual_seed(28081)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (TimesFmRMSNorm, nn.LayerNorm)):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
            if isinstance(m, nn.LayerNorm):
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model.eval()

"""Kyutai moshi's StreamingTransformer text LM (moshi/modules/transformer.py + rope.py), plain torch.

LMModel (text stream only): text_emb (ScaledEmbedding), transformer (StreamingTransformer: layers.N,
one shared RotaryEmbedding), out_norm, text_linear.  StreamingTransformerLayer: _sa_block
(norm1 -> self_attn(x, x, x) -> layer_scale_1 -> + x) then _ff_block (norm2 -> gating = ActivationGating
linear_in (d -> 2*hidden, SiLU gate) / linear_out -> layer_scale_2 -> + x).  Norms are moshi's RMSNorm
with an `alpha` (1, 1, d) gain.
StreamingMultiheadAttention: in_projs[0] fused (3*d, d) no bias, rearranged "b t (p h d) -> p b h t d",
moshi apply_rope: interleaved pairs (x viewed (..., D/2, 2)), freqs = max_period ** (-2i/D) with
max_period 1e4, at offset + arange(T); then `_complete_kv` and the position bias
attn_bias = (pos_k >= 0) & (delta >= 0) & (delta < context) with delta = pos_q - pos_k, so every layer
has a **sliding window of context = 3 keys** (itself included); F.scaled_dot_product_attention with that
boolean bias; out_projs[0].  MHA 4 x 16.
Streaming cache (book-buffers): `model.reset_kv_cache()`, `model(prompt, use_cache=True)`,
`model(tok, use_cache=True)`; each attention keeps a state with a linear key/value buffer
(batch, heads, 64, d), the positions pos_k of its entries (-1 when empty) and the offset.
`model(ids)` is the full forward and touches no state.  Returns the logits tensor.
Slip: one-token streaming steps build their bias with `_streaming_attn_bias`, which keeps the
pos_k >= 0 and delta >= 0 terms but not delta < context: a decoded token sees every cached key instead
of the last 3.  The full forward and the (multi-token) prompt pass use the right bias.  The step-0
divergence needs a prompt of at least 3 tokens (with a 1-token prompt the first divergent step is 2).
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
        "transformer.layers.0.self_attn",
        "transformer.layers.1.self_attn",
        "transformer.layers.2.self_attn",
    ],
    "kind": "causal-multihead",
    "cache": "book-buffers",
    "decode": {
        "mistake": "cache_mask",
        "step": 0,
        "layer": "transformer.layers.0.self_attn",
    },
    "style": "kyutai moshi StreamingTransformer: fused in_projs, interleaved apply_rope (max_period 1e4), context window 3 "
    "via attn_bias on pos_k/pos_q, SDPA with a boolean bias, RMSNorm alpha, ActivationGating; streaming state with "
    "linear kv buffers; the streaming bias drops delta < context",
}


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.alpha = nn.Parameter(torch.full((1, 1, dim), 1.0, requires_grad=True))

    def forward(self, x):
        var = self.eps + torch.mean(x**2, dim=2, keepdim=True)
        return x * (self.alpha.to(x.dtype) * torch.rsqrt(var))


def apply_rope(q, k, offset, max_period=10_000, time_before_heads=False):
    if time_before_heads:
        B, T, H, D = q.shape
    else:
        B, H, T, D = q.shape
    ds = torch.arange(D // 2, device=q.device, dtype=torch.float64)
    freqs = torch.exp(ds * (-math.log(max_period) * 2 / D))
    ts = offset + torch.arange(T, device=q.device, dtype=torch.float64)
    if time_before_heads:
        ts = ts.view(-1, 1, 1)
    else:
        ts = ts.view(1, -1, 1)
    dims = q.shape[:-1]
    q = q.view(*dims, D // 2, 2)
    k = k.view(*k.shape[:-1], D // 2, 2)
    qr, qi = q[..., 0], q[..., 1]
    kr, ki = k[..., 0], k[..., 1]
    rotr = torch.cos(freqs * ts).to(q.dtype)
    roti = torch.sin(freqs * ts).to(q.dtype)
    qor = qr * rotr - qi * roti
    qoi = qr * roti + qi * rotr
    kor = kr * rotr - ki * roti
    koi = kr * roti + ki * rotr
    qo = torch.stack([qor, qoi], dim=-1)
    ko = torch.stack([kor, koi], dim=-1)
    return qo.view(*dims, D), ko.view(*k.shape[:-2], D)


class RotaryEmbedding(nn.Module):
    def __init__(self, max_period=10000.0):
        super().__init__()
        self.max_period = max_period

    def forward(self, q, k, offset, time_before_heads=False):
        return apply_rope(q, k, offset, self.max_period, time_before_heads)


class StreamingMultiheadAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, causal=True, context=None, rope=None, max_len=64):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.causal = causal
        self.context = context
        self.rope = rope
        self.max_len = max_len
        self.in_projs = nn.ModuleList([nn.Linear(embed_dim, 3 * embed_dim, bias=False)])
        self.out_projs = nn.ModuleList([nn.Linear(embed_dim, embed_dim, bias=False)])
        self._streaming_state = None
        self._is_streaming = False

    def reset_streaming(self):
        self._streaming_state = None

    def _init_streaming_state(self, batch_size, dtype, device):
        dim_per_head = self.embed_dim // self.num_heads
        shape = (batch_size, self.num_heads, self.max_len, dim_per_head)
        return SimpleNamespace(
            k=torch.zeros(shape, dtype=dtype, device=device),
            v=torch.zeros(shape, dtype=dtype, device=device),
            pos_k=torch.full((self.max_len,), -1, dtype=torch.long, device=device),
            offset=0,
        )

    def _complete_kv(self, k, v):
        state = self._streaming_state if self._is_streaming else None
        if state is None:
            return k, v, torch.arange(k.shape[2], device=k.device, dtype=torch.long)
        T = k.shape[2]
        start = state.offset
        state.k[:, :, start : start + T] = k
        state.v[:, :, start : start + T] = v
        state.pos_k[start : start + T] = torch.arange(start, start + T, device=k.device)
        return state.k, state.v, state.pos_k

    def _attn_bias(self, pos_q, pos_k):
        delta = pos_q - pos_k
        attn_bias = (pos_k >= 0) & (delta >= 0)
        if self.context is not None:
            attn_bias = attn_bias & (delta < self.context)
        return attn_bias

    def _streaming_attn_bias(self, pos_q, pos_k):
        delta = pos_q - pos_k
        return (pos_k >= 0) & (delta >= 0)

    def forward(self, query, key, value):
        state = self._streaming_state if self._is_streaming else None
        if self._is_streaming and state is None:
            state = self._streaming_state = self._init_streaming_state(query.shape[0], query.dtype, query.device)
        B, T = query.shape[:2]
        offset = state.offset if state is not None else 0
        projected = self.in_projs[0](query)
        q, k, v = projected.view(B, T, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        if self.rope:
            q, k = self.rope(q, k, offset, time_before_heads=False)
        k, v, pos_k = self._complete_kv(k, v)
        pos_k = pos_k.view(1, -1)
        pos_q = offset + torch.arange(T, device=q.device, dtype=torch.long).view(-1, 1)
        if state is None or T > 1:
            attn_bias = self._attn_bias(pos_q, pos_k)
        else:  # one-token streaming step
            attn_bias = self._streaming_attn_bias(pos_q, pos_k)
        x = F.scaled_dot_product_attention(q, k, v, attn_bias, dropout_p=0.0)
        x = x.transpose(1, 2).reshape(B, T, self.embed_dim)
        x = self.out_projs[0](x)
        if state is not None:
            state.offset += T
        return x


class ActivationGating(nn.Module):
    def __init__(self, dim, dim_feedforward):
        super().__init__()
        hidden = 2 * dim_feedforward // 3
        self.linear_in = nn.Linear(dim, 2 * hidden, bias=False)
        self.linear_out = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        x = self.linear_in(x)
        B, T, _ = x.shape
        x = x.view(B, T, 2, -1)
        x = F.silu(x[..., 0, :]) * x[..., 1, :]
        return self.linear_out(x)


class StreamingTransformerLayer(nn.Module):
    def __init__(self, d_model, num_heads, dim_feedforward, context, rope):
        super().__init__()
        self.self_attn = StreamingMultiheadAttention(d_model, num_heads, causal=True, context=context, rope=rope)
        self.norm1 = RMSNorm(d_model)
        self.norm2 = RMSNorm(d_model)
        self.layer_scale_1 = nn.Identity()
        self.layer_scale_2 = nn.Identity()
        self.gating = ActivationGating(d_model, dim_feedforward)

    def _ff_block(self, x):
        x_orig = x
        update = self.gating(self.norm2(x))
        return x_orig + self.layer_scale_2(update)

    def _sa_block(self, x):
        x_orig = x
        x = self.norm1(x)
        update = self.self_attn(x, x, x)
        return x_orig + self.layer_scale_1(update)

    def forward(self, x):
        return self._ff_block(self._sa_block(x))


class StreamingTransformer(nn.Module):
    def __init__(self, d_model, num_heads, num_layers, dim_feedforward, context, max_period):
        super().__init__()
        self.rope = RotaryEmbedding(max_period=max_period)
        self.layers = nn.ModuleList(
            [StreamingTransformerLayer(d_model, num_heads, dim_feedforward, context, self.rope) for _ in range(num_layers)]
        )

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class LMModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.context = config.context
        self.text_emb = nn.Embedding(config.text_card + 1, config.dim)
        self.transformer = StreamingTransformer(
            config.dim, config.num_heads, config.num_layers, config.dim_feedforward, config.context, config.max_period
        )
        self.out_norm = RMSNorm(config.dim)
        self.text_linear = nn.Linear(config.dim, config.text_card, bias=False)

    def reset_kv_cache(self):
        for m in self.modules():
            if isinstance(m, StreamingMultiheadAttention):
                m.reset_streaming()

    def forward(self, input_ids, use_cache=False):
        for m in self.modules():
            if isinstance(m, StreamingMultiheadAttention):
                m._is_streaming = use_cache
        x = self.text_emb(input_ids)
        x = self.transformer(x)
        return self.text_linear(self.out_norm(x))


def make_model():
    torch.manual_seed(1612)
    config = SimpleNamespace(
        text_card=96, dim=64, num_heads=4, num_layers=3, dim_feedforward=192, context=3, max_period=10000.0
    )
    model = LMModel(config)
    g = torch.Generator().manual_seed(16121)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.alpha.copy_(1.0 + 0.3 * torch.randn(m.alpha.shape, generator=g))
    return model.eval()

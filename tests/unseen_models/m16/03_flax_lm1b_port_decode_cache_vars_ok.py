"""The Flax examples lm1b TransformerLM (flax/examples/lm1b/models.py) ported to PyTorch, decode cache included.

TransformerLM -> decoder (Decoder): Embed_0, posembed_output (AddPositionEmbs with the fixed
sinusoidal_init table: sin in the first half of the features, cos in the second, min_scale 1,
max_scale 1e4), encoderdecoderblock_0..2 as plain attributes (Flax names), encoderdecoder_norm,
logitdense (logits_via_embedding False).  EncoderDecoder1DBlock is pre-LN: LayerNorm_0 ->
SelfAttention_0 -> + inputs -> LayerNorm_1 -> MlpBlock_0 (Dense_0 relu Dense_1) -> + x.
SelfAttention_0 is flax.linen.SelfAttention: DenseGeneral query/key/value kernels (features, heads,
head_dim), no bias, query / sqrt(depth), einsum '...qhd,...khd->...hqk', jnp.where(mask, w, finfo.min),
softmax, einsum back, `out` DenseGeneral kernel (heads, head_dim, features).
Decode cache as Flax keeps it: each attention holds cached_key / cached_value (batch, max_length,
heads, head_dim) and cache_index, written at cache_index; the mask is arange(max_length) <= the query's
index (generalised here to a multi-token prefill); posembed_output keeps its own cache_index for the
position rows.
Cache: book-buffers: `model.reset_kv_cache()`, `model(prompt, use_cache=True)`,
`model(tok, use_cache=True)`; buffers are allocated for the batch at the first cached call (64
positions).  `model(ids)` is the full forward (causal mask from make_causal_mask) and touches no cache.
Returns the logits tensor.
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
        "decoder.encoderdecoderblock_0.SelfAttention_0",
        "decoder.encoderdecoderblock_1.SelfAttention_0",
        "decoder.encoderdecoderblock_2.SelfAttention_0",
    ],
    "kind": "causal-multihead",
    "cache": "book-buffers",
    "style": "flax examples lm1b TransformerLM port: Flax auto-names (encoderdecoderblock_N.SelfAttention_0), "
    "fixed sin|cos sinusoidal_init positions with a decode cache_index, DenseGeneral (features, heads, hd) "
    "kernels, query/sqrt(depth), where(mask, w, finfo.min); cached_key/cached_value/cache_index per attention",
}


def sinusoidal_init(max_len, d_feature, min_scale=1.0, max_scale=10000.0):
    pe = torch.zeros(max_len, d_feature, dtype=torch.float64)
    position = torch.arange(0, max_len, dtype=torch.float64)[:, None]
    scale_factor = -math.log(max_scale / min_scale) / (d_feature // 2 - 1)
    div_term = min_scale * torch.exp(torch.arange(0, d_feature // 2, dtype=torch.float64) * scale_factor)
    pe[:, : d_feature // 2] = torch.sin(position * div_term)
    pe[:, d_feature // 2 : 2 * (d_feature // 2)] = torch.cos(position * div_term)
    return pe[None]


class DenseGeneral(nn.Module):
    def __init__(self, in_shape, out_shape):
        super().__init__()
        self.in_shape = tuple(in_shape)
        self.out_shape = tuple(out_shape)
        fan_in = math.prod(self.in_shape)
        self.kernel = nn.Parameter(torch.randn(*self.in_shape, *self.out_shape) / math.sqrt(fan_in))

    def forward(self, x):
        n_in = len(self.in_shape)
        flat = x.reshape(*x.shape[: x.dim() - n_in], -1)
        y = flat @ self.kernel.reshape(-1, math.prod(self.out_shape))
        return y.reshape(*flat.shape[:-1], *self.out_shape)


class LayerNorm(nn.Module):
    def __init__(self, dim, epsilon=1e-6):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.epsilon = epsilon

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        var = (x - mean).pow(2).mean(-1, keepdim=True)
        return (x - mean) * torch.rsqrt(var + self.epsilon) * self.scale + self.bias


class AddPositionEmbs(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.max_len = config.max_len
        self.emb_dim = config.emb_dim
        self.cache_index = 0

    def forward(self, inputs, decode=False):
        length = inputs.shape[1]
        pos_embedding = sinusoidal_init(self.max_len, self.emb_dim).to(inputs.dtype).to(inputs.device)
        if decode:
            i = self.cache_index
            self.cache_index = i + length
            pe = pos_embedding[:, i : i + length]
        else:
            pe = pos_embedding[:, :length]
        return inputs + pe


class SelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.qkv_dim // config.num_heads
        self.max_len = config.max_len
        self.query = DenseGeneral((config.emb_dim,), (self.num_heads, self.head_dim))
        self.key = DenseGeneral((config.emb_dim,), (self.num_heads, self.head_dim))
        self.value = DenseGeneral((config.emb_dim,), (self.num_heads, self.head_dim))
        self.out = DenseGeneral((self.num_heads, self.head_dim), (config.emb_dim,))
        self.cached_key = None
        self.cached_value = None
        self.cache_index = 0

    def reset_cache(self):
        self.cached_key = None
        self.cached_value = None
        self.cache_index = 0

    def forward(self, inputs_q, mask=None, decode=False):
        query = self.query(inputs_q)
        key = self.key(inputs_q)
        value = self.value(inputs_q)
        if decode:
            b, t = inputs_q.shape[:2]
            if self.cached_key is None:
                shape = (b, self.max_len, self.num_heads, self.head_dim)
                self.cached_key = torch.zeros(shape, dtype=key.dtype, device=key.device)
                self.cached_value = torch.zeros(shape, dtype=value.dtype, device=value.device)
            cur_index = self.cache_index
            self.cached_key[:, cur_index : cur_index + t] = key
            self.cached_value[:, cur_index : cur_index + t] = value
            key, value = self.cached_key, self.cached_value
            self.cache_index = cur_index + t
            q_index = cur_index + torch.arange(t, device=inputs_q.device)
            mask = torch.arange(self.max_len, device=inputs_q.device)[None, :] <= q_index[:, None]
            mask = mask[None, None]
        depth = query.shape[-1]
        query = query / math.sqrt(depth)
        attn_weights = torch.einsum("...qhd,...khd->...hqk", query, key)
        if mask is not None:
            big_neg = torch.finfo(attn_weights.dtype).min
            attn_weights = torch.where(mask, attn_weights, torch.full_like(attn_weights, big_neg))
        attn_weights = torch.softmax(attn_weights, dim=-1)
        x = torch.einsum("...hqk,...khd->...qhd", attn_weights, value)
        return self.out(x)


class MlpBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.Dense_0 = nn.Linear(config.emb_dim, config.mlp_dim)
        self.Dense_1 = nn.Linear(config.mlp_dim, config.emb_dim)

    def forward(self, x):
        return self.Dense_1(F.relu(self.Dense_0(x)))


class EncoderDecoder1DBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.LayerNorm_0 = LayerNorm(config.emb_dim)
        self.SelfAttention_0 = SelfAttention(config)
        self.LayerNorm_1 = LayerNorm(config.emb_dim)
        self.MlpBlock_0 = MlpBlock(config)

    def forward(self, inputs, decoder_mask=None, decode=False):
        x = self.LayerNorm_0(inputs)
        x = self.SelfAttention_0(x, decoder_mask, decode=decode)
        x = x + inputs
        z = self.LayerNorm_1(x)
        z = self.MlpBlock_0(z)
        return x + z


class Decoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_layers = config.num_layers
        self.Embed_0 = nn.Embedding(config.output_vocab_size, config.emb_dim)
        self.posembed_output = AddPositionEmbs(config)
        for lyr in range(config.num_layers):
            setattr(self, f"encoderdecoderblock_{lyr}", EncoderDecoder1DBlock(config))
        self.encoderdecoder_norm = LayerNorm(config.emb_dim)
        self.logitdense = nn.Linear(config.emb_dim, config.output_vocab_size)

    def forward(self, inputs, decode=False):
        y = self.Embed_0(inputs)
        y = self.posembed_output(y, decode=decode)
        if decode:
            decoder_mask = None
        else:
            t = inputs.shape[1]
            decoder_mask = torch.tril(torch.ones(t, t, dtype=torch.bool, device=inputs.device))[None, None]
        for lyr in range(self.num_layers):
            y = getattr(self, f"encoderdecoderblock_{lyr}")(y, decoder_mask, decode=decode)
        y = self.encoderdecoder_norm(y)
        return self.logitdense(y)


class TransformerLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.decoder = Decoder(config)

    def reset_kv_cache(self):
        self.decoder.posembed_output.cache_index = 0
        for m in self.modules():
            if isinstance(m, SelfAttention):
                m.reset_cache()

    def forward(self, inputs, use_cache=False):
        return self.decoder(inputs, decode=use_cache)


def make_model():
    torch.manual_seed(1603)
    config = SimpleNamespace(
        output_vocab_size=96,
        emb_dim=64,
        num_heads=4,
        num_layers=3,
        qkv_dim=64,
        mlp_dim=128,
        max_len=64,
    )
    model = TransformerLM(config)
    g = torch.Generator().manual_seed(16031)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LayerNorm):
                m.scale.copy_(1.0 + 0.3 * torch.randn(m.scale.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model.eval()

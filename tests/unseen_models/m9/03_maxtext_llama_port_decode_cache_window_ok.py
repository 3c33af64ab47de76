"""Google MaxText (MaxText/layers/llama2.py + attentions.py) decoder ported to PyTorch with MaxText's
names, plus an explicit decode-cache object (small, random weights).

Transformer: token_embedder, decoder (Decoder: layers.N = LlamaDecoderLayer, decoder_norm) and
logits_dense.  LlamaDecoderLayer: pre_self_attention_layer_norm -> self_attention ->
post_self_attention_layer_norm -> mlp (MlpBlock: wi_0, wi_1, wo; silu(wi_0) * wi_1).
Attention: `query`, `key`, `value`, `out` are DenseGeneral modules whose kernels keep MaxText's
multi-axis layout, (embed, heads, head_dim) for q/k/v and (heads, head_dim, embed) for out,
applied with einsum; GQA 4 query / 2 kv heads (query head h reads kv head h // 2, via a
(kv, groups) reshape of the queries as in MaxText's `apply_attention_dot`), MaxText's
RotaryEmbedding (halves: first/second half of each head, timescale = min * (max/min)**(2i/d),
min 1, max 1e4), query scaled by 1/sqrt(head_dim) before the dot, and a sliding-window causal
mask (config `sliding_window_size = 8`: query i sees keys i-7 .. i) on every layer, large negative
fill (-0.7 * finfo.max, MaxText's DEFAULT_MASK_VALUE).
Cache: book-cache, an external object: `cache = mod.DecodeCache(num_layers=3)`,
`model(prompt, cache=cache)`, `model(tok, cache=cache)` (`get(i)`, `update(i, k, v)`, `length`);
every key is kept and the window is applied by the mask.  `model(ids)` is the full forward.
Returns the logits tensor.  Correct everywhere.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": [
        "decoder.layers.0.self_attention",
        "decoder.layers.1.self_attention",
        "decoder.layers.2.self_attention",
    ],
    "kind": "causal-multihead",
    "cache": "book-cache",
    "structure": {"heads": 4, "kv_heads": 2, "head_dim": 16, "causal": True, "cross": False,
                  "rope": {"pairing": "halves", "fraction": 1.0, "base": 10000.0},
                  "qk_norm": None, "window": 8, "bias": None},
    "style": "MaxText llama2 port: DenseGeneral kernels (embed, heads, hd) / (heads, hd, embed) with einsum, GQA via "
    "(kv, groups) query reshape, timescale RotaryEmbedding, sliding window 8 on all layers, -0.7*finfo.max fill, "
    "external DecodeCache passed as cache=",
}

DEFAULT_MASK_VALUE_FACTOR = -0.7


class DecodeCache:
    def __init__(self, num_layers):
        self.keys = [None] * num_layers
        self.values = [None] * num_layers
        self.length = 0

    def get(self, i):
        return self.keys[i], self.values[i]

    def update(self, i, k, v):
        if self.keys[i] is None:
            self.keys[i], self.values[i] = k, v
        else:
            self.keys[i] = torch.cat([self.keys[i], k], dim=1)
            self.values[i] = torch.cat([self.values[i], v], dim=1)
        return self.keys[i], self.values[i]


class DenseGeneral(nn.Module):
    def __init__(self, in_features, out_features, equation):
        super().__init__()
        in_f = (in_features,) if isinstance(in_features, int) else tuple(in_features)
        out_f = (out_features,) if isinstance(out_features, int) else tuple(out_features)
        fan_in = math.prod(in_f)
        self.kernel = nn.Parameter(torch.randn(*in_f, *out_f) / math.sqrt(fan_in))
        self.equation = equation

    def forward(self, x):
        return torch.einsum(self.equation, x, self.kernel.to(x.dtype))


class RMSNorm(nn.Module):
    def __init__(self, dim, epsilon=1e-5):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))
        self.epsilon = epsilon

    def forward(self, x):
        mean2 = torch.mean(x * x, dim=-1, keepdim=True)
        return x * torch.rsqrt(mean2 + self.epsilon) * self.scale


class RotaryEmbedding(nn.Module):
    def __init__(self, embedding_dims, min_timescale=1, max_timescale=10_000):
        super().__init__()
        half = embedding_dims // 2
        fraction = 2 * torch.arange(0, half, dtype=torch.float64) / embedding_dims
        timescale = min_timescale * (max_timescale / min_timescale) ** fraction
        self.register_buffer("timescale", timescale.float(), persistent=False)

    def forward(self, inputs, position):
        # inputs (b, s, n, d); position (b, s)
        sinusoid = position[:, :, None, None].to(inputs.dtype) / self.timescale.to(inputs.dtype)
        sin, cos = torch.sin(sinusoid), torch.cos(sinusoid)
        first_half, second_half = torch.split(inputs, inputs.shape[-1] // 2, dim=-1)
        first_part = first_half * cos - second_half * sin
        second_part = second_half * cos + first_half * sin
        return torch.cat([first_part, second_part], dim=-1)


class Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        e, n, kv, d = config.emb_dim, config.num_query_heads, config.num_kv_heads, config.head_dim
        self.num_query_heads, self.num_kv_heads, self.head_dim = n, kv, d
        self.sliding_window_size = config.sliding_window_size
        self.query = DenseGeneral(e, (n, d), "bse,end->bsnd")
        self.key = DenseGeneral(e, (kv, d), "bse,end->bsnd")
        self.value = DenseGeneral(e, (kv, d), "bse,end->bsnd")
        self.out = DenseGeneral((n, d), e, "bsnd,nde->bse")
        self.rotary = RotaryEmbedding(d)

    def apply_attention_dot(self, query, key, value, q_pos, k_pos):
        b, t, n, d = query.shape
        kv = self.num_kv_heads
        query = query.reshape(b, t, kv, n // kv, d)
        attn_weights = torch.einsum("btkgd,bskd->bkgts", query, key)
        allowed = (k_pos[None, :] <= q_pos[:, None]) & (q_pos[:, None] - k_pos[None, :] < self.sliding_window_size)
        mask_value = DEFAULT_MASK_VALUE_FACTOR * torch.finfo(attn_weights.dtype).max
        attn_weights = torch.where(allowed, attn_weights, torch.tensor(mask_value, dtype=attn_weights.dtype))
        probs = torch.softmax(attn_weights, dim=-1)
        out = torch.einsum("bkgts,bskd->btkgd", probs, value)
        return out.reshape(b, t, n, d)

    def forward(self, inputs_q, inputs_positions, layer_idx=0, cache=None):
        query = self.query(inputs_q)
        key = self.key(inputs_q)
        value = self.value(inputs_q)
        query = self.rotary(query, inputs_positions)
        key = self.rotary(key, inputs_positions)
        query = query / math.sqrt(self.head_dim)
        q_pos = inputs_positions[0]
        if cache is not None:
            key, value = cache.update(layer_idx, key, value)
        k_pos = torch.arange(key.shape[1], device=key.device)
        out = self.apply_attention_dot(query, key, value, q_pos, k_pos)
        return self.out(out)


class MlpBlock(nn.Module):
    def __init__(self, emb, mlp_dim):
        super().__init__()
        self.wi_0 = DenseGeneral(emb, mlp_dim, "bse,em->bsm")
        self.wi_1 = DenseGeneral(emb, mlp_dim, "bse,em->bsm")
        self.wo = DenseGeneral(mlp_dim, emb, "bsm,me->bse")

    def forward(self, x):
        return self.wo(F.silu(self.wi_0(x)) * self.wi_1(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.pre_self_attention_layer_norm = RMSNorm(config.emb_dim)
        self.self_attention = Attention(config)
        self.post_self_attention_layer_norm = RMSNorm(config.emb_dim)
        self.mlp = MlpBlock(config.emb_dim, config.mlp_dim)

    def forward(self, inputs, decoder_positions, cache=None):
        lnx = self.pre_self_attention_layer_norm(inputs)
        attention_lnx = self.self_attention(lnx, decoder_positions, layer_idx=self.layer_idx, cache=cache)
        intermediate_inputs = inputs + attention_lnx
        hidden = self.post_self_attention_layer_norm(intermediate_inputs)
        return intermediate_inputs + self.mlp(hidden)


class Decoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, i) for i in range(config.num_decoder_layers)])
        self.decoder_norm = RMSNorm(config.emb_dim)

    def forward(self, y, decoder_positions, cache=None):
        for layer in self.layers:
            y = layer(y, decoder_positions, cache=cache)
        return self.decoder_norm(y)


class Transformer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.token_embedder = nn.Embedding(config.vocab_size, config.emb_dim)
        self.decoder = Decoder(config)
        self.logits_dense = DenseGeneral(config.emb_dim, config.vocab_size, "bse,ev->bsv")

    def reset_kv_cache(self):
        pass

    def forward(self, decoder_input_tokens, cache=None):
        b, t = decoder_input_tokens.shape
        start = cache.length if cache is not None else 0
        positions = torch.arange(start, start + t, device=decoder_input_tokens.device)[None].expand(b, -1)
        y = self.token_embedder(decoder_input_tokens)
        y = self.decoder(y, positions, cache=cache)
        if cache is not None:
            cache.length += t
        return self.logits_dense(y)


class Config:
    vocab_size = 128
    emb_dim = 64
    mlp_dim = 160
    num_query_heads = 4
    num_kv_heads = 2
    head_dim = 16
    num_decoder_layers = 3
    sliding_window_size = 8


def make_model():
    torch.manual_seed(903)
    model = Transformer(Config())
    g = torch.Generator().manual_seed(9031)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.scale.copy_(1.0 + 0.3 * torch.randn(m.scale.shape, generator=g))
    return model.eval()

"""flaxformer decoder-only LM (google/flaxformer architectures/t5 DecoderOnly) ported to torch, 4 layers.

Same port as the other flaxformer files of this round: DecoderOnly -> decoder (token_embedder,
layers_0 .. layers_3 as attributes, decoder_norm), pre-norm DecoderLayer with T5LayerNorm `scale`,
DenseGeneral kernels (query (embed, heads, head_dim), multi-query key/value (embed, head_dim),
out (heads, head_dim, embed)), rotate-half rotary 1e4, causal bias 0 / -1e10, tied logits.
Cache (book-buffers): cached_key / cached_value (batch, heads, head_dim, length) + cache_index;
`model.reset_kv_cache()`, `model(prompt, use_cache=True)`, `model(tok, use_cache=True)`.
Slip: the gin config gives the layers a per-layer `rescale_logits` list, and layer 2 was left at
flaxformer's T5 default rescale_logits=False (the 1/sqrt(depth) is then expected to be folded into the
query initialiser, which this checkpoint never did), so layers_2 computes raw q.k scores with no
scale.  Every token still depends only on itself and earlier tokens, so cached decoding agrees with
the full pass.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": [
        "decoder.layers_0.self_attention",
        "decoder.layers_1.self_attention",
        "decoder.layers_2.self_attention",
        "decoder.layers_3.self_attention",
    ],
    "kind": "causal-multihead",
    "cache": "book-buffers",
    "layer": "decoder.layers_2.self_attention",
    "stage": "scaled_scores",
    "mistake": "missing_scale",
    "style": "flaxformer DecoderOnly ported, 4 layers, multi-query, rotate-half rotary, cache collection "
    "(b, h, d, length); per-layer rescale_logits list leaves layers_2 at the T5 default False: no 1/sqrt(d)",
}

MAX_LEN = 64
MAX_BATCH = 4


class T5LayerNorm(nn.Module):
    def __init__(self, dim, epsilon=1e-6):
        super().__init__()
        self.epsilon = epsilon
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        var = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(var + self.epsilon) * self.scale


def _rotary_tables(length, dim, offset, dtype, device, max_timescale=1e4):
    # flaxformer embedding.generate_fixed_pos_embedding: sin/cos over (length, dim) with halves tiled
    fraction = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    timescale = max_timescale**fraction
    pos = torch.arange(offset, offset + length, dtype=torch.float64)
    sinusoid = pos[:, None] / timescale[None, :]
    sin = torch.cat([torch.sin(sinusoid)] * 2, dim=-1)
    cos = torch.cat([torch.cos(sinusoid)] * 2, dim=-1)
    return sin.to(dtype=dtype, device=device), cos.to(dtype=dtype, device=device)


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary_embedding(q, k, cos, sin):
    # q: (b, l, h, d), k: (b, l, d) (multi-query), tables (l, d)
    qcos, qsin = cos[None, :, None, :], sin[None, :, None, :]
    kcos, ksin = cos[None, :, :], sin[None, :, :]
    return q * qcos + _rotate_half(q) * qsin, k * kcos + _rotate_half(k) * ksin


class DenseGeneral(nn.Module):
    def __init__(self, kernel_shape):
        super().__init__()
        self.kernel = nn.Parameter(torch.randn(*kernel_shape) / math.sqrt(kernel_shape[0]))


class MultiQueryDotProductAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, head_dim, rescale_logits=True):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.rescale_logits = rescale_logits
        self.query = DenseGeneral((embed_dim, num_heads, head_dim))
        self.key = DenseGeneral((embed_dim, head_dim))
        self.value = DenseGeneral((embed_dim, head_dim))
        self.out = DenseGeneral((num_heads, head_dim, embed_dim))
        with torch.no_grad():
            self.out.kernel.mul_(math.sqrt(embed_dim) / math.sqrt(num_heads * head_dim))
        self.register_buffer("cached_key", torch.zeros(MAX_BATCH, 1, head_dim, MAX_LEN), persistent=False)
        self.register_buffer("cached_value", torch.zeros(MAX_BATCH, 1, head_dim, MAX_LEN), persistent=False)
        self.cache_index = 0

    def reset_cache(self):
        self.cached_key.zero_()
        self.cached_value.zero_()
        self.cache_index = 0

    def forward(self, inputs_q, decode=False, prefill=False):
        b, l, _ = inputs_q.shape
        query = torch.einsum("bld,dhk->blhk", inputs_q, self.query.kernel)
        key = torch.einsum("bld,dk->blk", inputs_q, self.key.kernel)
        value = torch.einsum("bld,dk->blk", inputs_q, self.value.kernel)
        rotary_index = self.cache_index if decode else 0
        sin, cos = _rotary_tables(l, self.head_dim, rotary_index, inputs_q.dtype, inputs_q.device)
        query, key = apply_rotary_embedding(query, key, cos, sin)

        if (prefill or decode) and self.cached_key.dtype != key.dtype:
            self.cached_key = self.cached_key.to(key.dtype)
            self.cached_value = self.cached_value.to(value.dtype)
        if prefill:
            # write the prompt into slots [0, l) of the (b, 1, d, length) cache
            self.cached_key[:b, 0, :, :l] = key.transpose(1, 2)
            self.cached_value[:b, 0, :, :l] = value.transpose(1, 2)
            self.cache_index = l
        if decode:
            cur_index = self.cache_index
            length = self.cached_key.shape[-1]
            one_hot = F.one_hot(torch.tensor(cur_index), length).to(key.dtype)
            one_token_key = key.transpose(1, 2)[:, None]  # (b, 1, d, 1)
            one_token_value = value.transpose(1, 2)[:, None]
            self.cached_key[:b] = self.cached_key[:b] + one_hot * one_token_key
            self.cached_value[:b] = self.cached_value[:b] + one_hot * one_token_value
            self.cache_index = cur_index + 1
            key = self.cached_key[:b, 0].transpose(1, 2)  # (b, length, d)
            value = self.cached_value[:b, 0].transpose(1, 2)
            visible = torch.arange(length, device=inputs_q.device) <= cur_index
            bias = torch.where(visible, 0.0, -1e10).to(query.dtype)[None, None, None, :]
        else:
            causal = torch.ones(l, l, dtype=torch.bool, device=inputs_q.device).tril()
            bias = torch.where(causal, 0.0, -1e10).to(query.dtype)[None, None]

        # dense_attention.dot_product_attention_multiquery
        if self.rescale_logits:
            query = query / math.sqrt(self.head_dim)
        attn_weights = torch.einsum("bqhd,bkd->bhqk", query, key)
        attn_weights = attn_weights + bias
        attn_weights = torch.softmax(attn_weights, dim=-1)
        x = torch.einsum("bhqk,bkd->bqhd", attn_weights, value)
        return torch.einsum("bqhd,hde->bqe", x, self.out.kernel)


class MlpBlock(nn.Module):
    def __init__(self, embed_dim, mlp_dim):
        super().__init__()
        self.wi_0 = nn.Linear(embed_dim, mlp_dim, bias=False)
        self.wi_1 = nn.Linear(embed_dim, mlp_dim, bias=False)
        self.wo = nn.Linear(mlp_dim, embed_dim, bias=False)

    def forward(self, x):
        return self.wo(F.gelu(self.wi_0(x), approximate="tanh") * self.wi_1(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg, rescale_logits=True):
        super().__init__()
        self.pre_self_attention_layer_norm = T5LayerNorm(cfg["emb_dim"])
        self.self_attention = MultiQueryDotProductAttention(
            cfg["emb_dim"], cfg["num_heads"], cfg["head_dim"], rescale_logits=rescale_logits
        )
        self.pre_mlp_layer_norm = T5LayerNorm(cfg["emb_dim"])
        self.mlp = MlpBlock(cfg["emb_dim"], cfg["mlp_dim"])

    def forward(self, x, decode=False, prefill=False):
        y = self.self_attention(self.pre_self_attention_layer_norm(x), decode=decode, prefill=prefill)
        x = x + y
        return x + self.mlp(self.pre_mlp_layer_norm(x))


class Decoder(nn.Module):
    def __init__(self, cfg, rescale=None):
        super().__init__()
        self.num_layers = cfg["num_layers"]
        self.token_embedder = nn.Embedding(cfg["vocab_size"], cfg["emb_dim"])
        for i in range(self.num_layers):
            r = True if rescale is None else rescale[i]
            setattr(self, f"layers_{i}", DecoderLayer(cfg, rescale_logits=r))
        self.decoder_norm = T5LayerNorm(cfg["emb_dim"])

    def forward(self, ids, decode=False, prefill=False):
        x = self.token_embedder(ids)
        for i in range(self.num_layers):
            x = getattr(self, f"layers_{i}")(x, decode=decode, prefill=prefill)
        x = self.decoder_norm(x)
        # embedder.attend (tied logits), rescaled as flaxformer does for shared embeddings
        return torch.einsum("bld,vd->blv", x, self.token_embedder.weight) / math.sqrt(x.shape[-1])


class DecoderOnly(nn.Module):
    def __init__(self, cfg, rescale=None):
        super().__init__()
        self.decoder = Decoder(cfg, rescale)
        self._cache_started = False

    def reset_kv_cache(self):
        for i in range(self.decoder.num_layers):
            getattr(self.decoder, f"layers_{i}").self_attention.reset_cache()
        self._cache_started = False

    def forward(self, ids, use_cache=False):
        if not use_cache:
            return self.decoder(ids)
        if not self._cache_started:
            self._cache_started = True
            return self.decoder(ids, prefill=True)
        if ids.shape[1] != 1:
            raise ValueError("flaxformer decode handles one token per step")
        return self.decoder(ids, decode=True)


def make_model():
    torch.manual_seed(2505)
    cfg = dict(vocab_size=96, emb_dim=64, num_heads=4, head_dim=16, mlp_dim=128, num_layers=4)
    rescale_logits = [True, True, False, True]
    model = DecoderOnly(cfg, rescale=rescale_logits)
    g = torch.Generator().manual_seed(25051)
    with torch.no_grad():
        model.decoder.token_embedder.weight.normal_(0.0, 1.0, generator=g)
        for m in model.modules():
            if isinstance(m, T5LayerNorm):
                m.scale.copy_(1.0 + 0.3 * torch.randn(m.scale.shape, generator=g))
    return model.eval()

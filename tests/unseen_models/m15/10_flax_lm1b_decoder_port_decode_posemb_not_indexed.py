"""The flax examples/lm1b TransformerLM (examples/lm1b/models.py), ported to torch module by module.

TransformerLM -> decoder (Decoder: `Embed_0` token embedding, `posembed_output` AddPositionEmbs with the
fixed sinusoidal table of `sinusoidal_init` (sin block then cos block, max_scale 1e4), blocks as attributes
`encoderdecoderblock_0..2`, `encoderdecoder_norm`, `logitdense`).  EncoderDecoder1DBlock (pre-norm):
`LayerNorm_0` -> `SelfAttention_0` -> + inputs; `LayerNorm_1` -> `MlpBlock_0` (Dense_0, relu, Dense_1)
-> + x.  SelfAttention_0 is flax's MultiHeadDotProductAttention: DenseGeneral `query`/`key`/`value`
kernels (features, heads, head_dim) and `out` kernel (heads, head_dim, features), no bias, query /
sqrt(head_dim), einsum('...qhd,...khd->...hqk'), where(mask, w, finfo.min), softmax, einsum, out.
Decode (flax `decode=True`): each attention keeps `cached_key` / `cached_value` (b, 64, h, d) and a
`cache_index`; new keys are written with dynamic_update_slice at cache_index, and the mask lets a query
at position p see slots <= p.  The port accepts a multi-token prefill (flax itself decodes one token
at a time).  Cache: book-buffers: `model.reset_kv_cache()`, `model(ids, use_cache=True)` (= decode=True);
`model(ids)` is the full pass.
Slip: AddPositionEmbs decides between its decode branch (dynamic_slice of the table at its own
cache_index) and the training branch (table[:length]) with `self.has_variable('cache', 'cache_index')`,
ported as a flag that is set only by `init_cache()`, which the port's reset never calls.  So in decoding
every call takes the training branch: the prompt is embedded at 0..P-1 (right), each decoded token at
position 0.  Attention caches and masks are right.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": [
        "decoder.encoderdecoderblock_0.SelfAttention_0",
        "decoder.encoderdecoderblock_1.SelfAttention_0",
        "decoder.encoderdecoderblock_2.SelfAttention_0",
    ],
    "kind": "causal-multihead",
    "cache": "book-buffers",
    "decode": {
        "mistake": "cache_positions",
        "step": 0,
        "layer": "decoder.encoderdecoderblock_0.SelfAttention_0",
    },
    "style": "flax examples/lm1b TransformerLM port: DenseGeneral (features, heads, dim) kernels by einsum, sinusoidal "
    "AddPositionEmbs, decode cached_key/cached_value/cache_index; slip: posembed never enters its decode branch, "
    "so decoded tokens are embedded at position 0",
}


def sinusoidal_init(max_len, d_feature, min_scale=1.0, max_scale=10000.0):
    pe = torch.zeros(max_len, d_feature, dtype=torch.float64)
    position = torch.arange(0, max_len, dtype=torch.float64)[:, None]
    scale_factor = -math.log(max_scale / min_scale) / (d_feature // 2 - 1)
    div_term = min_scale * torch.exp(torch.arange(0, d_feature // 2, dtype=torch.float64) * scale_factor)
    pe[:, : d_feature // 2] = torch.sin(position * div_term)
    pe[:, d_feature // 2 : 2 * (d_feature // 2)] = torch.cos(position * div_term)
    return pe[None]


class AddPositionEmbs(nn.Module):
    def __init__(self, max_len, d_model):
        super().__init__()
        self.pos_embedding = sinusoidal_init(max_len, d_model)  # float64, cast at use
        self.cache_index = 0
        self.has_cache_index = False  # flax: self.has_variable('cache', 'cache_index')

    def init_cache(self):
        self.cache_index = 0
        self.has_cache_index = True

    def forward(self, inputs, decode=False):
        length = inputs.shape[1]
        table = self.pos_embedding.to(device=inputs.device, dtype=inputs.dtype)
        if decode and self.has_cache_index:
            i = self.cache_index
            self.cache_index = i + length
            return inputs + table[:, i : i + length]
        return inputs + table[:, :length]


class DenseGeneral(nn.Module):
    def __init__(self, shape, std):
        super().__init__()
        self.kernel = nn.Parameter(torch.randn(*shape) * std)


class MultiHeadDotProductAttention(nn.Module):
    def __init__(self, features, num_heads, max_len):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = features // num_heads
        self.max_len = max_len
        self.query = DenseGeneral((features, num_heads, self.head_dim), features ** -0.5)
        self.key = DenseGeneral((features, num_heads, self.head_dim), features ** -0.5)
        self.value = DenseGeneral((features, num_heads, self.head_dim), features ** -0.5)
        self.out = DenseGeneral((num_heads, self.head_dim, features), features ** -0.5)
        self.reset_cache()

    def reset_cache(self):
        self.cached_key = None
        self.cached_value = None
        self.cache_index = 0

    def forward(self, x, decode=False):
        b, t, _ = x.shape
        query = torch.einsum("btf,fhd->bthd", x, self.query.kernel)
        key = torch.einsum("btf,fhd->bthd", x, self.key.kernel)
        value = torch.einsum("btf,fhd->bthd", x, self.value.kernel)
        if decode:
            if self.cached_key is None:
                self.cached_key = x.new_zeros(b, self.max_len, self.num_heads, self.head_dim)
                self.cached_value = x.new_zeros(b, self.max_len, self.num_heads, self.head_dim)
            cur_index = self.cache_index
            self.cached_key = self.cached_key.clone()
            self.cached_value = self.cached_value.clone()
            self.cached_key[:, cur_index : cur_index + t] = key
            self.cached_value[:, cur_index : cur_index + t] = value
            self.cache_index = cur_index + t
            key, value = self.cached_key, self.cached_value
            q_pos = torch.arange(cur_index, cur_index + t, device=x.device)[:, None]
        else:
            q_pos = torch.arange(t, device=x.device)[:, None]
        k_pos = torch.arange(key.shape[1], device=x.device)[None, :]
        mask = (k_pos <= q_pos)[None, None]
        query = query / math.sqrt(self.head_dim)
        attn_weights = torch.einsum("bqhd,bkhd->bhqk", query, key)
        attn_weights = torch.where(mask, attn_weights, torch.finfo(attn_weights.dtype).min)
        attn_weights = torch.softmax(attn_weights, dim=-1)
        y = torch.einsum("bhqk,bkhd->bqhd", attn_weights, value)
        return torch.einsum("bqhd,hdf->bqf", y, self.out.kernel)


class MlpBlock(nn.Module):
    def __init__(self, d_model, mlp_dim):
        super().__init__()
        self.Dense_0 = nn.Linear(d_model, mlp_dim)
        self.Dense_1 = nn.Linear(mlp_dim, d_model)

    def forward(self, x):
        return self.Dense_1(F.relu(self.Dense_0(x)))


class EncoderDecoder1DBlock(nn.Module):
    def __init__(self, d_model, num_heads, mlp_dim, max_len):
        super().__init__()
        self.LayerNorm_0 = nn.LayerNorm(d_model, eps=1e-6)
        self.SelfAttention_0 = MultiHeadDotProductAttention(d_model, num_heads, max_len)
        self.LayerNorm_1 = nn.LayerNorm(d_model, eps=1e-6)
        self.MlpBlock_0 = MlpBlock(d_model, mlp_dim)

    def forward(self, inputs, decode=False):
        x = inputs + self.SelfAttention_0(self.LayerNorm_0(inputs), decode=decode)
        return x + self.MlpBlock_0(self.LayerNorm_1(x))


class Decoder(nn.Module):
    def __init__(self, vocab_size=96, emb_dim=64, num_heads=4, num_layers=3, mlp_dim=128, max_len=64):
        super().__init__()
        self.num_layers = num_layers
        self.Embed_0 = nn.Embedding(vocab_size, emb_dim)
        self.posembed_output = AddPositionEmbs(max_len, emb_dim)
        for lyr in range(num_layers):
            self.add_module(f"encoderdecoderblock_{lyr}", EncoderDecoder1DBlock(emb_dim, num_heads, mlp_dim, max_len))
        self.encoderdecoder_norm = nn.LayerNorm(emb_dim, eps=1e-6)
        self.logitdense = nn.Linear(emb_dim, vocab_size)

    def forward(self, inputs, decode=False):
        y = self.Embed_0(inputs)
        y = self.posembed_output(y, decode=decode)
        for lyr in range(self.num_layers):
            y = getattr(self, f"encoderdecoderblock_{lyr}")(y, decode=decode)
        return self.logitdense(self.encoderdecoder_norm(y))


class TransformerLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.decoder = Decoder()

    def reset_kv_cache(self):
        for m in self.modules():
            if isinstance(m, MultiHeadDotProductAttention):
                m.reset_cache()
        self.decoder.posembed_output.cache_index = 0

    def forward(self, inputs, use_cache=False):
        return self.decoder(inputs, decode=use_cache)


def make_model():
    torch.manual_seed(1510)
    model = TransformerLM()
    g = torch.Generator().manual_seed(15101)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model.eval()

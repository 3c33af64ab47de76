"""A one-codebook MusicGen language model in the style of facebookresearch/audiocraft
(audiocraft/models/lm.py + audiocraft/modules/transformer.py + audiocraft/modules/rope.py).

LMModel: `emb` (a ModuleList of ScaledEmbedding, one per codebook; n_q = 1 here, so the input is token
ids (b, t) rather than (b, K, t)), `transformer` (StreamingTransformer: a shared `rope` RotaryEmbedding
and `layers.N`), `out_norm` (LayerNorm) and `linears` (one head per codebook).
StreamingTransformerLayer (norm_first): norm1 -> self_attn -> + x; norm2 -> linear2(gelu(linear1)) -> + x.
StreamingMultiheadAttention with custom=True, kv_repeat=2 (4 query heads, 2 kv heads of 16): one packed
`in_proj_weight` (64 + 2 * 32, 64) sliced into q | k | v, rearranged "b t (h d) -> b t h d", keys and
values widened with `expand_repeated_kv` (x[:, :, :, None].expand(...).reshape: query head h reads
kv head h // 2), RotaryEmbedding: complex rotation of interleaved pairs (view_as_complex), max_period
1e4, queries rotated at `start + streaming_offset`, keys at `start`.  Memory-efficient path: SDPA in
"b h t d" layout with a boolean causal mask built from query/key positions; out_proj.
Cache: book-buffers.  audiocraft keeps past keys/values in each module's `_streaming_state`; here
`model.reset_kv_cache()` clears every state (reset_streaming) and `model(ids, use_cache=True)` streams
(appends to the state, positions start at the state's offset).  `model(ids)` is the stateless full pass.
Correct everywhere.
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
        "transformer.layers.0.self_attn",
        "transformer.layers.1.self_attn",
        "transformer.layers.2.self_attn",
    ],
    "kind": "causal-multihead",
    "cache": "book-buffers",
    "style": "audiocraft StreamingTransformer LM (n_q=1): packed in_proj_weight with kv_repeat=2 (GQA 4/2, "
    "expand_repeated_kv), complex interleaved RotaryEmbedding max_period 1e4 with streaming offset, SDPA "
    "with boolean causal mask, _streaming_state caches reset by reset_kv_cache()",
}


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, max_period=10000.0, scale=1.0):
        super().__init__()
        assert dim % 2 == 0
        self.scale = scale
        self.frequencies = 1.0 / (max_period ** (torch.arange(0, dim, 2, dtype=torch.float64)[: dim // 2] / dim))

    def rotation(self, start, end, device):
        idx = torch.arange(start, end, device=device, dtype=torch.float64)
        angles = torch.outer(idx, self.frequencies.to(device)) * self.scale
        return torch.polar(torch.ones_like(angles), angles)

    def rotate(self, x, start=0, time_dim=1):
        T = x.shape[time_dim]
        target_shape = [1 for _ in range(x.dim())]
        target_shape[time_dim] = T
        target_shape[-1] = -1
        rotation = self.rotation(start, start + T, x.device).view(target_shape)
        x_complex = torch.view_as_complex(x.to(torch.float64).reshape(*x.shape[:-1], -1, 2))
        x_out = torch.view_as_real(x_complex * rotation).view_as(x)
        return x_out.type_as(x)

    def rotate_qk(self, query, key, start=0, time_dim=1):
        streaming_offset = key.shape[time_dim] - query.shape[time_dim]
        query_out = self.rotate(query, start + streaming_offset, time_dim)
        key_out = self.rotate(key, start, time_dim)
        return query_out, key_out


def expand_repeated_kv(x, n_rep):
    if n_rep == 1:
        return x
    bs, slen, n_kv_heads, head_dim = x.shape
    return x[:, :, :, None, :].expand(bs, slen, n_kv_heads, n_rep, head_dim).reshape(
        bs, slen, n_kv_heads * n_rep, head_dim
    )


class StreamingModule(nn.Module):
    def __init__(self):
        super().__init__()
        self._streaming_state = {}
        self._is_streaming = False

    def reset_streaming(self):
        self._streaming_state = {}


class StreamingMultiheadAttention(StreamingModule):
    def __init__(self, embed_dim, num_heads, bias=False, causal=True, rope=None, kv_repeat=1):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.causal = causal
        self.rope = rope
        self.kv_repeat = kv_repeat
        self.per_head_dim = embed_dim // num_heads
        self.kv_heads = num_heads // kv_repeat
        out_dim = embed_dim + 2 * self.per_head_dim * self.kv_heads
        self.in_proj_weight = nn.Parameter(torch.empty(out_dim, embed_dim))
        nn.init.normal_(self.in_proj_weight, std=embed_dim ** -0.5)
        self.in_proj_bias = nn.Parameter(torch.zeros(out_dim)) if bias else None
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)

    def _complete_kv(self, k, v):
        if not self._is_streaming:
            return k, v
        if "past_keys" in self._streaming_state:
            k = torch.cat([self._streaming_state["past_keys"], k], dim=1)
            v = torch.cat([self._streaming_state["past_values"], v], dim=1)
        self._streaming_state["past_keys"] = k
        self._streaming_state["past_values"] = v
        return k, v

    def _get_mask(self, q_len, k_len, device):
        past = k_len - q_len
        queries_pos = torch.arange(past, k_len, device=device).view(-1, 1)
        keys_pos = torch.arange(k_len, device=device).view(1, -1)
        return keys_pos <= queries_pos

    def forward(self, query, key=None, value=None, use_cache=False):
        self._is_streaming = use_cache
        projected = F.linear(query, self.in_proj_weight, self.in_proj_bias)
        b, t, _ = projected.shape
        q = projected[:, :, : self.embed_dim]
        start = self.embed_dim
        end = start + self.per_head_dim * self.kv_heads
        k = projected[:, :, start:end]
        v = projected[:, :, end:]
        q = q.reshape(b, t, self.num_heads, self.per_head_dim)
        k = k.reshape(b, t, self.kv_heads, self.per_head_dim)
        v = v.reshape(b, t, self.kv_heads, self.per_head_dim)
        offset = self._streaming_state.get("offset", 0) if self._is_streaming else 0
        if self.rope is not None:
            q, k = self.rope.rotate_qk(q, k, start=offset, time_dim=1)
        k, v = self._complete_kv(k, v)
        if self._is_streaming:
            self._streaming_state["offset"] = offset + t
        k = expand_repeated_kv(k, self.kv_repeat)
        v = expand_repeated_kv(v, self.kv_repeat)
        q, k, v = [x.transpose(1, 2) for x in (q, k, v)]
        attn_mask = self._get_mask(q.shape[2], k.shape[2], q.device) if self.causal else None
        x = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=0.0)
        x = x.transpose(1, 2).reshape(b, t, self.embed_dim)
        return self.out_proj(x), None


class StreamingTransformerLayer(nn.Module):
    def __init__(self, d_model, num_heads, dim_feedforward, rope, kv_repeat):
        super().__init__()
        self.self_attn = StreamingMultiheadAttention(d_model, num_heads, causal=True, rope=rope, kv_repeat=kv_repeat)
        self.linear1 = nn.Linear(d_model, dim_feedforward, bias=False)
        self.linear2 = nn.Linear(dim_feedforward, d_model, bias=False)
        self.norm1 = nn.LayerNorm(d_model, eps=1e-5)
        self.norm2 = nn.LayerNorm(d_model, eps=1e-5)

    def forward(self, x, use_cache=False):
        x = x + self.self_attn(self.norm1(x), use_cache=use_cache)[0]
        x = x + self.linear2(F.gelu(self.linear1(self.norm2(x))))
        return x


class StreamingTransformer(nn.Module):
    def __init__(self, d_model, num_heads, num_layers, dim_feedforward, max_period, kv_repeat):
        super().__init__()
        self.rope = RotaryEmbedding(d_model // num_heads, max_period=max_period)
        self.layers = nn.ModuleList(
            [StreamingTransformerLayer(d_model, num_heads, dim_feedforward, self.rope, kv_repeat) for _ in range(num_layers)]
        )

    def forward(self, x, use_cache=False):
        for layer in self.layers:
            x = layer(x, use_cache=use_cache)
        return x


class ScaledEmbedding(nn.Embedding):
    pass


class LMModel(nn.Module):
    def __init__(self, n_q=1, card=96, dim=64, num_heads=4, num_layers=3, hidden_scale=2, kv_repeat=2):
        super().__init__()
        self.n_q = n_q
        self.emb = nn.ModuleList([ScaledEmbedding(card + 1, dim) for _ in range(n_q)])
        self.transformer = StreamingTransformer(dim, num_heads, num_layers, hidden_scale * dim, 10000.0, kv_repeat)
        self.out_norm = nn.LayerNorm(dim, eps=1e-5)
        self.linears = nn.ModuleList([nn.Linear(dim, card, bias=False) for _ in range(n_q)])

    def reset_kv_cache(self):
        for m in self.modules():
            if isinstance(m, StreamingModule):
                m.reset_streaming()

    def forward(self, sequence, use_cache=False):
        if sequence.dim() == 2:
            sequence = sequence[:, None, :]
        input_ = sum(self.emb[k](sequence[:, k]) for k in range(self.n_q))
        out = self.transformer(input_, use_cache=use_cache)
        out = self.out_norm(out)
        return self.linears[0](out)


def make_model():
    torch.manual_seed(1502)
    model = LMModel()
    g = torch.Generator().manual_seed(15021)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model.eval()

"""ESPnet's Transformer LM (espnet/nets/pytorch_backend/lm/transformer.py) in plain torch.

TransformerLM: embed (nn.Embedding, 32) -> encoder (Encoder: embed = LinearInput: Linear ->
LayerNorm -> ReLU -> PositionalEncoding (x * sqrt(d) + sinusoid, sin on even and cos on odd
features), encoders.N = EncoderLayer (normalize_before: norm1 -> self_attn -> residual, norm2 ->
feed_forward w_1/w_2 -> residual), after_norm) -> decoder (Linear to the vocabulary).
MultiHeadedAttention: linear_q/k/v/out with bias, (b, h, t, d_k), matmul / sqrt(d_k),
mask.unsqueeze(1).eq(0) filled with finfo.min before the softmax and with 0.0 after it; causal mask
= subsequent_mask (tril, True = visible).  MHA 4/4.
Cache: book-cache.  `cache = mod.KVCache(n_layers=N)` (a LayerOutputCache), `model(prompt,
cache=cache)`, then `model(tok, cache=cache)` one token at a time.  As in espnet's forward_one_step
/ batch_score the cache holds each block's OUTPUTS (and here also the embedded prefix, since the
driver feeds only the new token): a step re-normalises the whole prefix, takes the query from the
last row (x[:, -1:]), and concatenates the new row onto the block's cached outputs.
Correct: no slip; 3 blocks.
"""

import math

import torch
from torch import nn

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": [
        "encoder.encoders.0.self_attn",
        "encoder.encoders.1.self_attn",
        "encoder.encoders.2.self_attn",
    ],
    "kind": "causal-multihead",
    "cache": "book-cache",
    "style": "espnet TransformerLM: LinearInput + sinusoidal x*sqrt(d)+pe, pre-norm "
    "EncoderLayer, MultiHeadedAttention masked_fill finfo.min before and 0.0 after "
    "softmax; book-cache of per-block outputs (forward_one_step)",
}

# Per-block attention settings (ESPnet builds each block from `encoder_selfattn_layer_args`).
# scale_dim: the dimension whose square root divides the scores; pre_softmax_mask: masked_fill
# with finfo.min before the softmax (the masked_fill(mask, 0.0) after it is always done).
BLOCK_ARGS = {}


def subsequent_mask(size, device=None):
    return torch.tril(torch.ones(size, size, dtype=torch.bool, device=device))


class PositionalEncoding(nn.Module):
    """espnet PositionalEncoding: x * sqrt(d) + pe, pe[:, 0::2] = sin, pe[:, 1::2] = cos."""

    def __init__(self, d_model):
        super().__init__()
        self.d_model = d_model
        self.xscale = math.sqrt(d_model)

    def forward(self, x, offset=0):
        length = x.size(1)
        position = torch.arange(offset, offset + length, dtype=torch.float64, device=x.device)[
            :, None
        ]
        div_term = torch.exp(
            torch.arange(0, self.d_model, 2, dtype=torch.float64, device=x.device)
            * -(math.log(10000.0) / self.d_model)
        )
        pe = torch.zeros(length, self.d_model, dtype=torch.float64, device=x.device)
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        return x * self.xscale + pe.to(x.dtype)[None]


class LinearInput(nn.Module):
    """Encoder input_layer="linear": Linear -> LayerNorm -> ReLU -> positional encoding."""

    def __init__(self, idim, odim):
        super().__init__()
        self.linear = nn.Linear(idim, odim)
        self.norm = nn.LayerNorm(odim, eps=1e-12)
        self.pos_enc = PositionalEncoding(odim)

    def forward(self, x, offset=0):
        return self.pos_enc(torch.relu(self.norm(self.linear(x))), offset)


class MultiHeadedAttention(nn.Module):
    def __init__(self, n_head, n_feat, scale_dim=None, pre_softmax_mask=True):
        super().__init__()
        self.d_k = n_feat // n_head
        self.h = n_head
        self.scale_dim = self.d_k if scale_dim is None else scale_dim
        self.pre_softmax_mask = pre_softmax_mask
        self.linear_q = nn.Linear(n_feat, n_feat)
        self.linear_k = nn.Linear(n_feat, n_feat)
        self.linear_v = nn.Linear(n_feat, n_feat)
        self.linear_out = nn.Linear(n_feat, n_feat)

    def forward_qkv(self, query, key, value):
        n_batch = query.size(0)
        q = self.linear_q(query).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        k = self.linear_k(key).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        v = self.linear_v(value).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        return q, k, v

    def forward_attention(self, value, scores, mask):
        n_batch = value.size(0)
        mask = mask.unsqueeze(1).eq(0)  # (batch, 1, time1, time2), True = hidden
        if self.pre_softmax_mask:
            scores = scores.masked_fill(mask, torch.finfo(scores.dtype).min)
        attn = torch.softmax(scores, dim=-1).masked_fill(mask, 0.0)
        x = torch.matmul(attn, value)
        x = x.transpose(1, 2).contiguous().view(n_batch, -1, self.h * self.d_k)
        return self.linear_out(x)

    def forward(self, query, key, value, mask):
        q, k, v = self.forward_qkv(query, key, value)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.scale_dim)
        return self.forward_attention(v, scores, mask)


class PositionwiseFeedForward(nn.Module):
    def __init__(self, idim, hidden_units):
        super().__init__()
        self.w_1 = nn.Linear(idim, hidden_units)
        self.w_2 = nn.Linear(hidden_units, idim)

    def forward(self, x):
        return self.w_2(torch.relu(self.w_1(x)))


class EncoderLayer(nn.Module):
    """normalize_before=True, concat_after=False; `cache` is this layer's previous outputs."""

    def __init__(self, size, self_attn, feed_forward):
        super().__init__()
        self.self_attn = self_attn
        self.feed_forward = feed_forward
        self.norm1 = nn.LayerNorm(size, eps=1e-12)
        self.norm2 = nn.LayerNorm(size, eps=1e-12)
        self.size = size

    def forward(self, x, mask, cache=None):
        residual = x
        x = self.norm1(x)
        if cache is None:
            x_q = x
        else:
            x_q = x[:, -1:, :]
            residual = residual[:, -1:, :]
            mask = mask[:, -1:, :]
        x = residual + self.self_attn(x_q, x, x, mask)
        residual = x
        x = residual + self.feed_forward(self.norm2(x))
        if cache is not None:
            x = torch.cat([cache, x], dim=1)
        return x, mask


class Encoder(nn.Module):
    def __init__(self, idim, attention_dim, attention_heads, linear_units, num_blocks):
        super().__init__()
        self.embed = LinearInput(idim, attention_dim)
        self.encoders = nn.ModuleList(
            [
                EncoderLayer(
                    attention_dim,
                    MultiHeadedAttention(attention_heads, attention_dim, **BLOCK_ARGS.get(i, {})),
                    PositionwiseFeedForward(attention_dim, linear_units),
                )
                for i in range(num_blocks)
            ]
        )
        self.after_norm = nn.LayerNorm(attention_dim, eps=1e-12)

    def forward(self, xs, masks):
        xs = self.embed(xs)
        for layer in self.encoders:
            xs, masks = layer(xs, masks)
        return self.after_norm(xs), masks


class LayerOutputCache:
    """espnet's batch_score state, kept in one object because the driver feeds one new token a call:
    `embedded` is the encoder input of the whole prefix, `outputs[i]` block i's outputs so far."""

    def __init__(self, n_layers):
        self.n_layers = n_layers
        self.embedded = None
        self.outputs = [None] * n_layers

    def seq_len(self):
        return 0 if self.embedded is None else self.embedded.size(1)

    def get(self, i):
        return self.outputs[i]

    def update(self, i, x):
        self.outputs[i] = x


KVCache = LayerOutputCache


class TransformerLM(nn.Module):
    """espnet/nets/pytorch_backend/lm/transformer.py: embed -> encoder (causal) -> decoder."""

    def __init__(self, n_vocab, embed_unit, att_unit, head, unit, layer):
        super().__init__()
        self.embed = nn.Embedding(n_vocab, embed_unit)
        self.encoder = Encoder(embed_unit, att_unit, head, unit, layer)
        self.decoder = nn.Linear(att_unit, n_vocab)

    def reset_kv_cache(self):
        pass

    def forward(self, x, cache=None):
        if cache is not None:
            return self.forward_one_step(x, cache)
        mask = subsequent_mask(x.size(1), x.device).unsqueeze(0)
        h, _ = self.encoder(self.embed(x), mask)
        return self.decoder(h)

    def forward_one_step(self, x, cache):
        offset = cache.seq_len()
        emb = self.encoder.embed(self.embed(x), offset)
        if offset == 0:
            mask = subsequent_mask(x.size(1), x.device).unsqueeze(0)
            cache.embedded = emb
            h = emb
            for i, layer in enumerate(self.encoder.encoders):
                h, _ = layer(h, mask)
                cache.update(i, h)
            return self.decoder(self.encoder.after_norm(h))
        if x.size(1) != 1:
            raise ValueError("forward_one_step takes one new token per call")
        h = torch.cat([cache.embedded, emb], dim=1)
        cache.embedded = h
        for i, layer in enumerate(self.encoder.encoders):
            mask = subsequent_mask(h.size(1), x.device).unsqueeze(0)
            h, _ = layer(h, mask, cache=cache.get(i))
            cache.update(i, h)
        return self.decoder(self.encoder.after_norm(h[:, -1:]))


def make_model():
    torch.manual_seed(2701)
    model = TransformerLM(n_vocab=96, embed_unit=32, att_unit=64, head=4, unit=128, layer=3)
    g = torch.Generator().manual_seed(2701 + 1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model.eval()

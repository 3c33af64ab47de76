"""CosyVoice (FunAudioLLM) TransformerLM over speech tokens, its `llm` being a WeNet TransformerEncoder
used causally, with a preallocated (export-friendly) attention cache.

TransformerLM: `speech_embedding`, `llm` (TransformerEncoder: `embed` = EmbedNoSubsampling holding the
WeNet `pos_enc` PositionalEncoding (x * sqrt(d) + sinusoid, sin on even / cos on odd features, float64
table cast at use, offset = frames already seen), `encoders.N` TransformerEncoderLayer, `after_norm`),
`llm_decoder`.  TransformerEncoderLayer (normalize_before): norm1 -> self_attn -> + residual -> norm2
-> feed_forward (w_1, ReLU, w_2) -> + residual.  MultiHeadedAttention: linear_q / linear_k / linear_v /
linear_out with bias, `forward_qkv` to (b, h, t, d_k), scores q k^T / sqrt(d_k), `forward_attention`
masked_fill(-inf) -> softmax -> masked_fill(0.0) when a mask is given (the WeNet "fake mask" of size 0
means no mask, used for one-frame steps).  MHA 4 x 16.  The cache is one buffer per layer,
(b, h, 64, 2 * d_k), keys and values concatenated on the last axis as in WeNet's att_cache.
Cache: book-buffers: `model.reset_kv_cache()`, `model(prompt, use_cache=True)`, `model(tok, use_cache=True)`
(batch <= 4, 64 frames).  `model(ids)` is the full causal forward and touches no cache.  Returns the
logits tensor.
Slip: on a step with frames already cached, the attention first writes the new frame's k‖v into the
buffer at `offset`, then reads the buffer back up to `offset + T` (it should stop at `offset`) and
concatenates the new k, v again: the current frame enters its own attention twice, exactly as if the
cache had been updated twice.  The prompt pass (offset 0) uses k, v directly and is exact; the full
forward is exact.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": [
        "llm.encoders.0.self_attn",
        "llm.encoders.1.self_attn",
        "llm.encoders.2.self_attn",
    ],
    "kind": "causal-multihead",
    "cache": "book-buffers",
    "decode": {
        "mistake": "cache_stale",
        "step": 0,
        "layer": "llm.encoders.0.self_attn",
    },
    "style": "CosyVoice TransformerLM / WeNet TransformerEncoder: x*sqrt(d) + interleaved sin/cos PositionalEncoding "
    "with offset, linear_q/k/v/out, forward_attention masked_fill -inf / 0.0 with the size-0 fake mask on one-frame "
    "steps, preallocated k||v att_cache; slip: the buffer is read up to offset + T after the write and the new k, v "
    "concatenated again",
}


class PositionalEncoding(nn.Module):
    def __init__(self, d_model, max_len=64):
        super().__init__()
        self.d_model = d_model
        self.xscale = math.sqrt(self.d_model)
        pe = torch.zeros(max_len, d_model, dtype=torch.float64)
        position = torch.arange(0, max_len, dtype=torch.float64).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float64) * -(math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.register_buffer("pe", pe.unsqueeze(0), persistent=False)

    def position_encoding(self, offset, size):
        return self.pe[:, offset : offset + size]

    def forward(self, x, offset=0):
        pos_emb = self.position_encoding(offset, x.size(1)).to(x.dtype)
        return x * self.xscale + pos_emb, pos_emb


class EmbedNoSubsampling(nn.Module):
    def __init__(self, d_model):
        super().__init__()
        self.pos_enc = PositionalEncoding(d_model)

    def forward(self, x, offset=0):
        return self.pos_enc(x, offset)


class MultiHeadedAttention(nn.Module):
    def __init__(self, n_head, n_feat):
        super().__init__()
        self.d_k = n_feat // n_head
        self.h = n_head
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
        if mask.size(2) > 0:
            mask = mask.unsqueeze(1).eq(0)
            scores = scores.masked_fill(mask, -float("inf"))
            attn = torch.softmax(scores, dim=-1).masked_fill(mask, 0.0)
        else:
            attn = torch.softmax(scores, dim=-1)
        x = torch.matmul(attn, value)
        x = x.transpose(1, 2).contiguous().view(n_batch, -1, self.h * self.d_k)
        return self.linear_out(x)

    def forward(self, query, key, value, mask, att_cache=None, offset=0):
        q, k, v = self.forward_qkv(query, key, value)
        if att_cache is not None:
            T = k.size(2)
            att_cache[:, :, offset : offset + T] = torch.cat((k, v), dim=-1)
            if offset > 0:
                cached = att_cache[:, :, : offset + T]
                key_cache, value_cache = torch.split(cached, cached.size(-1) // 2, dim=-1)
                k = torch.cat([key_cache, k], dim=2)
                v = torch.cat([value_cache, v], dim=2)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.d_k)
        return self.forward_attention(v, scores, mask)


class PositionwiseFeedForward(nn.Module):
    def __init__(self, idim, hidden_units):
        super().__init__()
        self.w_1 = nn.Linear(idim, hidden_units)
        self.w_2 = nn.Linear(hidden_units, idim)

    def forward(self, xs):
        return self.w_2(F.relu(self.w_1(xs)))


class TransformerEncoderLayer(nn.Module):
    def __init__(self, size, self_attn, feed_forward):
        super().__init__()
        self.self_attn = self_attn
        self.feed_forward = feed_forward
        self.norm1 = nn.LayerNorm(size, eps=1e-12)
        self.norm2 = nn.LayerNorm(size, eps=1e-12)
        self.normalize_before = True

    def forward(self, x, mask, att_cache=None, offset=0):
        residual = x
        x = self.norm1(x)
        x = residual + self.self_attn(x, x, x, mask, att_cache=att_cache, offset=offset)
        residual = x
        return residual + self.feed_forward(self.norm2(x))


class TransformerEncoder(nn.Module):
    def __init__(self, output_size=64, attention_heads=4, linear_units=128, num_blocks=3):
        super().__init__()
        self.embed = EmbedNoSubsampling(output_size)
        self.encoders = nn.ModuleList(
            [
                TransformerEncoderLayer(
                    output_size,
                    MultiHeadedAttention(attention_heads, output_size),
                    PositionwiseFeedForward(output_size, linear_units),
                )
                for _ in range(num_blocks)
            ]
        )
        self.after_norm = nn.LayerNorm(output_size, eps=1e-5)

    def forward(self, xs, offset=0, att_caches=None):
        T = xs.size(1)
        xs, _ = self.embed(xs, offset)
        if T > 1 or att_caches is None:
            # subsequent_mask shifted by the frames already cached
            att_mask = torch.tril(torch.ones(T, offset + T, dtype=torch.bool, device=xs.device), diagonal=offset)
            att_mask = att_mask.unsqueeze(0)
        else:
            att_mask = torch.ones((1, 0, 0), dtype=torch.bool, device=xs.device)
        for i, layer in enumerate(self.encoders):
            xs = layer(xs, att_mask, att_cache=None if att_caches is None else att_caches[i], offset=offset)
        return self.after_norm(xs)


class TransformerLM(nn.Module):
    def __init__(self, vocab_size=96, llm_output_size=64):
        super().__init__()
        self.speech_embedding = nn.Embedding(vocab_size, llm_output_size)
        self.llm = TransformerEncoder(output_size=llm_output_size)
        self.llm_decoder = nn.Linear(llm_output_size, vocab_size)
        self.max_batch, self.max_frames = 4, 64
        self.att_caches = None
        self.offset = 0

    def reset_kv_cache(self):
        self.att_caches = None
        self.offset = 0

    def forward(self, input_ids, use_cache=False):
        xs = self.speech_embedding(input_ids)
        if not use_cache:
            return self.llm_decoder(self.llm(xs))
        b = input_ids.size(0)
        if self.att_caches is None:
            self.att_caches = [
                torch.zeros(b, layer.self_attn.h, self.max_frames, 2 * layer.self_attn.d_k, dtype=xs.dtype, device=xs.device)
                for layer in self.llm.encoders
            ]
            self.offset = 0
        out = self.llm(xs, offset=self.offset, att_caches=self.att_caches)
        self.offset += input_ids.size(1)
        return self.llm_decoder(out)


def make_model():
    torch.manual_seed(1811)
    model = TransformerLM()
    g = torch.Generator().manual_seed(18111)
    with torch.no_grad():
        model.speech_embedding.weight.normal_(0.0, 0.2, generator=g)
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model.eval()

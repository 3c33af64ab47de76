"""wenet / CosyVoice transformer (wenet-e2e/wenet wenet/transformer/attention.py, reused by
FunAudioLLM/CosyVoice cosyvoice/transformer/): MultiHeadedAttention(n_head, n_feat, dropout_rate,
query_bias, key_bias, value_bias, use_sdpa, n_kv_head, head_dim) with linear_q/linear_k/linear_v/
linear_out, _forward_linearx / forward_qkv to (batch, head, time, d_k), forward_attention with a
boolean (batch, 1 or time, time) mask (masked_fill -inf, softmax, masked_fill 0.0), grouped kv heads
by repeat_interleave (a single kv head broadcasts), RopeMultiHeadedAttention with
WENET_APPLY_ROTARY_EMB styles ("google" halves / "llama" complex pairs), subsequent_mask for the
decoder, pre-norm (normalize_before) encoder and decoder layers.

This file: one bug: forward_attention normalises with torch.softmax(scores, dim=1): over the head axis."""

import math

import torch
from torch import nn


class MultiHeadedAttention(nn.Module):
    def __init__(self, n_head, n_feat, dropout_rate, query_bias=True, key_bias=True,
                 value_bias=True, use_sdpa=False, n_kv_head=None, head_dim=None):
        super().__init__()
        self.inner_dim = n_feat if head_dim is None else head_dim * n_head
        if n_kv_head is not None:
            assert head_dim is not None
            self.inner_kv_dim = head_dim * n_kv_head
        else:
            self.inner_kv_dim = self.inner_dim
            n_kv_head = n_head
        self.d_k = self.inner_dim // n_head
        assert self.d_k == self.inner_kv_dim // n_kv_head
        self.h = n_head
        self.h_kv = n_kv_head
        self.linear_q = nn.Linear(n_feat, self.inner_dim, bias=query_bias)
        self.linear_k = nn.Linear(n_feat, self.inner_kv_dim, bias=key_bias)
        self.linear_v = nn.Linear(n_feat, self.inner_kv_dim, bias=value_bias)
        self.linear_out = nn.Linear(self.inner_dim, n_feat, bias=query_bias)
        self.dropout = nn.Dropout(p=dropout_rate)
        self.use_sdpa = use_sdpa
        self.dropout_rate = dropout_rate

    def _forward_linearx(self, name, x, head_first=True):
        assert x.ndim >= 3
        if name == "query":
            x = self.linear_q(x)
            x_shape = x.size()
            x_shape = x_shape[:-1] + torch.Size([self.h, self.d_k])
        elif name == "key":
            x = self.linear_k(x)
            x_shape = x.size()
            x_shape = x_shape[:-1] + torch.Size([self.h_kv, self.d_k])
        else:
            assert name == "value"
            x = self.linear_v(x)
            x_shape = x.size()
            x_shape = x_shape[:-1] + torch.Size([self.h_kv, self.d_k])
        x = x.view(x_shape)
        if head_first:
            x = x.transpose(-3, -2)  # (batch, head, time, d_k)
        return x

    def forward_qkv(self, query, key, value):
        q = self._forward_linearx("query", query)
        k = self._forward_linearx("key", key)
        v = self._forward_linearx("value", value)
        return q, k, v

    def forward_attention(self, value, scores, mask=torch.ones((0, 0, 0), dtype=torch.bool)):
        if mask.size(2) > 0:  # time2 > 0
            mask = mask.unsqueeze(1).eq(0)  # (batch, 1, *, time2)
            mask = mask[..., : scores.size(-1)]
            scores = scores.masked_fill(mask, -float("inf"))
            attn = torch.softmax(scores, dim=1).masked_fill(mask, 0.0)
        else:
            attn = torch.softmax(scores, dim=-1)
        p_attn = self.dropout(attn)
        x = torch.matmul(p_attn, value)  # (batch, head, time1, d_k)
        x = x.transpose(-3, -2).contiguous()
        x_shape = x.size()[:-2] + torch.Size([self.h * self.d_k])
        x = x.view(x_shape)  # (batch, time1, d_model)
        return self.linear_out(x)

    def forward(self, query, key, value, mask=torch.ones((0, 0, 0), dtype=torch.bool),
                pos_emb=torch.empty(0)):
        q, k, v = self.forward_qkv(query, key, value)
        if self.h_kv != self.h and self.h_kv != 1:
            k = torch.repeat_interleave(k, self.h // self.h_kv, dim=-3)
            v = torch.repeat_interleave(v, self.h // self.h_kv, dim=-3)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.d_k)
        return self.forward_attention(v, scores, mask)


def precompute_freqs_cis(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64)[: (dim // 2)] / dim))
    t = torch.arange(end, dtype=torch.float64)
    freqs = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(freqs), freqs)  # complex128


def _complex_for(x, freqs_cis):
    real_dtype = torch.promote_types(x.dtype, torch.float32)
    return real_dtype, freqs_cis.to(torch.complex128 if real_dtype == torch.float64 else torch.complex64)


def google_apply_rotary_emb(x, freqs_cis):
    # x: (batch, time, head, d_k); pairs are (i, i + d_k/2)
    real_dtype, freqs_cis = _complex_for(x, freqs_cis)
    x_ = torch.view_as_complex(torch.stack(torch.chunk(x.to(real_dtype), 2, dim=-1), dim=-1))
    x_out = torch.view_as_real(x_ * freqs_cis)
    x_out = torch.cat(torch.chunk(x_out, 2, dim=-1), dim=-2)
    x_out = x_out.reshape(x_out.shape[0], x_out.shape[1], x_out.shape[2], -1)
    return x_out.type_as(x)


def llama_apply_rotary_emb(x, freqs_cis):
    # x: (batch, time, head, d_k); pairs are (2i, 2i + 1)
    real_dtype, freqs_cis = _complex_for(x, freqs_cis)
    x_ = torch.view_as_complex(x.to(real_dtype).reshape(*x.shape[:-1], -1, 2))
    x_out = torch.view_as_real(x_ * freqs_cis).flatten(3)
    return x_out.type_as(x)


WENET_APPLY_ROTARY_EMB = {"google": google_apply_rotary_emb, "llama": llama_apply_rotary_emb}


class RopeMultiHeadedAttention(MultiHeadedAttention):
    def __init__(self, n_head, n_feat, dropout_rate, query_bias=True, key_bias=True,
                 value_bias=True, use_sdpa=False, n_kv_head=None, head_dim=None, style="google"):
        super().__init__(n_head, n_feat, dropout_rate, query_bias, key_bias, value_bias,
                         use_sdpa, n_kv_head, head_dim)
        self.style = style

    def forward(self, query, key, value, mask=torch.ones((0, 0, 0), dtype=torch.bool),
                pos_emb=torch.empty(0)):
        q = self._forward_linearx("query", query, head_first=False)
        k = self._forward_linearx("key", key, head_first=False)
        v = self._forward_linearx("value", value, head_first=False)
        # pos_emb: (time, d_k // 2) complex, broadcast over batch and head
        freqs = pos_emb[None, :, None, :]
        q = WENET_APPLY_ROTARY_EMB[self.style](q, freqs)
        k = WENET_APPLY_ROTARY_EMB[self.style](k, freqs)
        q = q.transpose(1, 2)
        k = k.transpose(1, 2)
        v = v.transpose(1, 2)
        if self.h_kv != self.h and self.h_kv != 1:
            k = torch.repeat_interleave(k, self.h // self.h_kv, dim=-3)
            v = torch.repeat_interleave(v, self.h // self.h_kv, dim=-3)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.d_k)
        return self.forward_attention(v, scores, mask)


class PositionwiseFeedForward(nn.Module):
    def __init__(self, idim, hidden_units, dropout_rate):
        super().__init__()
        self.w_1 = nn.Linear(idim, hidden_units)
        self.activation = nn.SiLU()
        self.dropout = nn.Dropout(dropout_rate)
        self.w_2 = nn.Linear(hidden_units, idim)

    def forward(self, xs):
        return self.w_2(self.dropout(self.activation(self.w_1(xs))))


def subsequent_mask(size, device=torch.device("cpu")):
    arange = torch.arange(size, device=device)
    mask = arange.expand(size, size)
    arange = arange.unsqueeze(-1)
    return mask <= arange  # (size, size), True where visible


def make_pad_mask_free(batch, length, device):
    return torch.ones(batch, 1, length, dtype=torch.bool, device=device)


class TransformerEncoderLayer(nn.Module):
    def __init__(self, size, self_attn, feed_forward, dropout_rate, normalize_before=True):
        super().__init__()
        self.self_attn = self_attn
        self.feed_forward = feed_forward
        self.norm1 = nn.LayerNorm(size, eps=1e-5)
        self.norm2 = nn.LayerNorm(size, eps=1e-5)
        self.dropout = nn.Dropout(dropout_rate)
        self.normalize_before = normalize_before

    def forward(self, x, mask, pos_emb):
        residual = x
        if self.normalize_before:
            x = self.norm1(x)
        x = residual + self.dropout(self.self_attn(x, x, x, mask, pos_emb))
        residual = x
        if self.normalize_before:
            x = self.norm2(x)
        return residual + self.dropout(self.feed_forward(x))


class DecoderLayer(nn.Module):
    def __init__(self, size, self_attn, src_attn, feed_forward, dropout_rate, normalize_before=True):
        super().__init__()
        self.size = size
        self.self_attn = self_attn
        self.src_attn = src_attn
        self.feed_forward = feed_forward
        self.norm1 = nn.LayerNorm(size, eps=1e-5)
        self.norm2 = nn.LayerNorm(size, eps=1e-5)
        self.norm3 = nn.LayerNorm(size, eps=1e-5)
        self.dropout = nn.Dropout(dropout_rate)
        self.normalize_before = normalize_before

    def forward(self, tgt, tgt_mask, memory, memory_mask):
        residual = tgt
        if self.normalize_before:
            tgt = self.norm1(tgt)
        tgt_q = tgt
        tgt_q_mask = tgt_mask
        x = residual + self.dropout(self.self_attn(tgt_q, tgt, tgt, tgt_q_mask))

        residual = x
        if self.normalize_before:
            x = self.norm2(x)
        x = residual + self.dropout(self.src_attn(x, memory, memory, memory_mask))

        residual = x
        if self.normalize_before:
            x = self.norm3(x)
        return residual + self.dropout(self.feed_forward(x))


class TransformerEncoder(nn.Module):
    """Encoder stack without the conv subsampling front end (features come in already embedded)."""

    def __init__(self, output_size=64, attention_heads=4, linear_units=128, num_blocks=1,
                 dropout_rate=0.0, static_chunk_size=0):
        super().__init__()
        self.static_chunk_size = static_chunk_size
        self.encoders = nn.ModuleList([
            TransformerEncoderLayer(
                output_size,
                MultiHeadedAttention(attention_heads, output_size, dropout_rate),
                PositionwiseFeedForward(output_size, linear_units, dropout_rate),
                dropout_rate,
                normalize_before=True,
            ) for _ in range(num_blocks)
        ])
        self.after_norm = nn.LayerNorm(output_size, eps=1e-5)

    def forward(self, xs):
        masks = make_pad_mask_free(xs.size(0), xs.size(1), xs.device)  # (B, 1, T)
        chunk_masks = masks
        pos_emb = torch.empty(0)
        for layer in self.encoders:
            xs = layer(xs, chunk_masks, pos_emb)
        return self.after_norm(xs)


def make_cosyvoice_encoder():
    torch.manual_seed(3503)
    model = TransformerEncoder(output_size=64, attention_heads=4)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {'target': 'make_cosyvoice_encoder',
 'kind': 'multihead',
 'ok': False,
 'layer': 'encoders.0.self_attn',
 'stage': 'weights',
 'mistake': 'softmax_wrong_dim',
 'style': 'wenet / CosyVoice MultiHeadedAttention (wenet-e2e/wenet wenet/transformer/attention.py, '
          'FunAudioLLM/CosyVoice): one bug: forward_attention normalises with '
          'torch.softmax(scores, dim=1): over the head axis'}

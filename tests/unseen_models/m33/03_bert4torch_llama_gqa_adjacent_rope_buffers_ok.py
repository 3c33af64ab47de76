"""bert4torch (Tongjilibo/bert4torch) decoder-only LM in its own naming, written out standalone.

Decoder: embeddings.word_embeddings, decoderLayer.N (attnLayerNorm -> multiHeadAttention ->
ffnLayerNorm -> feedForward with intermediateDense/intermediateDense2/outputDense, pre-norm,
RMS `LayerNorm` with weight only), LayerNormFinal, lm_head.  MultiHeadAttentionLayer: q/k/v/o,
transpose_for_scores, `relative_positions_encoding` = RoPEPositionEncoding (rope_rank 'adjacent'
= interleaved pairs, 'updown' = halves; tables from position ids in float64), kv heads expanded
with repeat_interleave, matmul / sqrt(d), scores + (1 - mask) * -10000, softmax, o.
3 layers, GQA 4/2, interleaved rotary theta 1e4.
Cache: book-buffers: `model.reset_kv_cache()`, `model(prompt, use_cache=True)`, then
`model(tok, use_cache=True)`; returns the logits tensor.  Each multiHeadAttention keeps
`past_key_value` (rotated keys and values, (b, kv_heads, T, 16)) grown on dim 2;
`model(ids)` ignores the buffers.  The mask (1/0, added as (1 - mask) * -10000) is built by the
model from the cache length for every layer.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": [
        "decoderLayer.0.multiHeadAttention",
        "decoderLayer.1.multiHeadAttention",
        "decoderLayer.2.multiHeadAttention",
    ],
    "kind": "causal-multihead",
    "cache": "book-buffers",
    "structure": {
        "heads": 4,
        "kv_heads": 2,
        "head_dim": 16,
        "causal": True,
        "rope": {"pairing": "interleaved", "fraction": 1.0, "base": 10000.0},
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "bert4torch LLaMA-style decoderLayer.N.multiHeadAttention: GQA 4/2 (repeat_interleave), "
    "rope_rank 'adjacent' (interleaved pairs) theta 1e4, no bias, RMS norms, (1 - mask) * "
    "-10000, past_key_value buffers",
}


class LayerNorm(nn.Module):
    """bert4torch LayerNorm with norm_mode='rmsnorm' (weight only)."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


class RoPEPositionEncoding(nn.Module):
    """bert4torch rotary: rope_rank 'adjacent' (pairs 2i, 2i+1) or 'updown' (halves).

    Tables are computed in float64 from the position ids at call time and cast.
    """

    def __init__(
        self, embedding_size, rope_rank="adjacent", rope_theta=10000.0, table_rank=None
    ):
        super().__init__()
        self.embedding_size = embedding_size
        self.rope_rank = rope_rank
        self.table_rank = table_rank or rope_rank
        self.rope_theta = rope_theta

    def forward(self, qw, position_ids):
        d = self.embedding_size
        inv_freq = 1.0 / (
            self.rope_theta
            ** (torch.arange(0, d, 2, dtype=torch.float64, device=qw.device) / d)
        )
        angles = position_ids.to(torch.float64)[..., None] * inv_freq  # (b, s, d/2)
        if self.table_rank == "adjacent":
            cos = angles.cos().repeat_interleave(2, dim=-1)
            sin = angles.sin().repeat_interleave(2, dim=-1)
        else:
            cos = torch.cat([angles.cos(), angles.cos()], dim=-1)
            sin = torch.cat([angles.sin(), angles.sin()], dim=-1)
        cos = cos[:, None].to(qw.dtype)
        sin = sin[:, None].to(qw.dtype)
        if self.rope_rank == "adjacent":
            qw2 = torch.stack([-qw[..., 1::2], qw[..., ::2]], dim=-1).reshape_as(qw)
        else:
            qw2 = torch.cat([-qw[..., d // 2 :], qw[..., : d // 2]], dim=-1)
        return qw * cos + qw2 * sin


class MultiHeadAttentionLayer(nn.Module):
    """bert4torch MultiHeadAttentionLayer (p_bias='rotary') with its own past_key_value."""

    def __init__(self, config, layer_idx):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        hd = self.attention_head_size
        bias = config.qkv_bias
        self.q = nn.Linear(config.hidden_size, self.num_attention_heads * hd, bias=bias)
        self.k = nn.Linear(config.hidden_size, self.num_key_value_heads * hd, bias=bias)
        self.v = nn.Linear(config.hidden_size, self.num_key_value_heads * hd, bias=bias)
        self.o = nn.Linear(
            self.num_attention_heads * hd, config.hidden_size, bias=False
        )
        self.relative_positions_encoding = RoPEPositionEncoding(
            hd,
            rope_rank=config.rope_rank,
            rope_theta=config.rope_theta,
            table_rank=config.rope_table_rank.get(layer_idx),
        )
        if config.qk_norm:
            self.q_norm = LayerNorm(hd, eps=config.layer_norm_eps)
            self.k_norm = LayerNorm(hd, eps=config.layer_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.sliding_window = config.sliding_window
        self.past_key_value = None

    def transpose_for_scores(self, x, heads):
        return x.view(x.size(0), x.size(1), heads, self.attention_head_size).permute(
            0, 2, 1, 3
        )

    def forward(self, hidden_states, attention_mask, position_ids, use_cache=False):
        q = self.transpose_for_scores(self.q(hidden_states), self.num_attention_heads)
        k = self.transpose_for_scores(self.k(hidden_states), self.num_key_value_heads)
        v = self.transpose_for_scores(self.v(hidden_states), self.num_key_value_heads)
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = self.relative_positions_encoding(q, position_ids)
        k = self.relative_positions_encoding(k, position_ids)
        if use_cache:
            if self.past_key_value is not None:
                k = torch.cat([self.past_key_value[0], k], dim=2)
                v = torch.cat([self.past_key_value[1], v], dim=2)
            self.past_key_value = (k, v)
        n_rep = self.num_attention_heads // self.num_key_value_heads
        k = k.repeat_interleave(n_rep, dim=1)
        v = v.repeat_interleave(n_rep, dim=1)
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(
            self.attention_head_size
        )
        scores = scores + (1.0 - attention_mask) * -10000.0
        probs = F.softmax(scores, dim=-1)
        context = torch.matmul(probs, v).permute(0, 2, 1, 3).contiguous()
        context = context.view(context.size(0), context.size(1), -1)
        return self.o(context)


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.attnLayerNorm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.multiHeadAttention = MultiHeadAttentionLayer(config, layer_idx)
        self.ffnLayerNorm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        h, i = config.hidden_size, config.intermediate_size
        self.feedForward = nn.ModuleDict(
            {
                "intermediateDense": nn.Linear(h, i, bias=False),
                "intermediateDense2": nn.Linear(h, i, bias=False),
                "outputDense": nn.Linear(i, h, bias=False),
            }
        )

    def forward(self, x, attention_mask, position_ids, use_cache=False):
        h = self.attnLayerNorm(x)
        x = x + self.multiHeadAttention(
            h, attention_mask, position_ids, use_cache=use_cache
        )
        h = self.ffnLayerNorm(x)
        ff = self.feedForward
        return x + ff["outputDense"](
            F.silu(ff["intermediateDense"](h)) * ff["intermediateDense2"](h)
        )


class Decoder(nn.Module):
    """bert4torch decoder LM (LLaMA-style): embeddings, decoderLayer.N, LayerNormFinal, lm_head."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embeddings = nn.ModuleDict(
            {"word_embeddings": nn.Embedding(config.vocab_size, config.hidden_size)}
        )
        self.decoderLayer = nn.ModuleList(
            [DecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.LayerNormFinal = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def reset_kv_cache(self):
        for layer in self.decoderLayer:
            layer.multiHeadAttention.past_key_value = None

    def _past_length(self):
        past = self.decoderLayer[0].multiHeadAttention.past_key_value
        return 0 if past is None else past[0].shape[2]

    def compute_attention_mask(
        self, seq_len, past, window, dtype, device, cached_step=False, inclusive=False
    ):
        """LM_Mask: key j visible from query i if j <= i (and i - j < window)."""
        q_pos = torch.arange(past, past + seq_len, device=device)[:, None]
        k_pos = torch.arange(past + seq_len, device=device)[None, :]
        mask = k_pos <= q_pos
        if window is not None:
            start = q_pos
            if cached_step and self.config.window_anchor_before_append:
                start = q_pos - 1
            mask = mask & (
                (start - k_pos <= window) if inclusive else (start - k_pos < window)
            )
        return mask.to(dtype)[None, None]

    def forward(self, input_ids, use_cache=False):
        b, s = input_ids.shape
        past = self._past_length() if use_cache else 0
        if use_cache and past > 0:
            cached = self.decoderLayer[0].multiHeadAttention.past_key_value[0]
            if cached.shape[0] != b:
                raise ValueError("the cache was started with another batch size")
        if past + s > self.config.max_position:
            raise ValueError("more positions than max_position")
        x = self.embeddings["word_embeddings"](input_ids)
        position_ids = torch.arange(past, past + s, device=input_ids.device)[
            None
        ].expand(b, -1)
        for i, layer in enumerate(self.decoderLayer):
            window = layer.multiHeadAttention.sliding_window
            mask = self.compute_attention_mask(
                s,
                past,
                window,
                x.dtype,
                x.device,
                cached_step=use_cache and past > 0,
                inclusive=i in self.config.window_inclusive_layers,
            )
            x = layer(x, mask, position_ids, use_cache=use_cache)
        return self.lm_head(self.LayerNormFinal(x))


def make_model():
    torch.manual_seed(3303)
    config = SimpleNamespace(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        layer_norm_eps=1e-6,
        max_position=64,
        window_inclusive_layers=(),
        window_anchor_before_append=False,
        rope_table_rank={},
        num_key_value_heads=2,
        qkv_bias=False,
        rope_rank="adjacent",
        rope_theta=10000.0,
        qk_norm=False,
        sliding_window=None,
    )
    model = Decoder(config)
    g = torch.Generator().manual_seed(3303 * 10 + 1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

"""IBM foundation-model-stack (fms) `MultiHeadAttention`: `UnfusedQKV` query/key/value Linears with
per-head emb_kq/emb_v independent of emb_dim, a `position_encoder` that either adjusts q/k
(`RotaryEmbedding.adjusted_qk`, 2x2 rotation matrices on consecutive pairs) or the mask
(`Alibi.adjusted_mask`), GQA by unsqueeze/expand/flatten, SDPA, `dense` output.

This file: correct (GQA 8:4, head_dim 8, fms RotaryEmbedding with 2x2 rotation matrices on
consecutive pairs, base 10000, SDPA is_causal)."""

import math

import torch
import torch.nn.functional as F
from torch import nn

class PositionEncoder(nn.Module):
    def adjusted_qk(self, q, k, position_ids, past_kv_state=None, use_cache=False):
        return q, k

    def adjusted_mask(self, mask, q, k, past_kv_state=None, use_cache=False):
        return mask

class RotaryEmbedding(PositionEncoder):
    """fms-style rotary: a cache of 2x2 rotation matrices [[cos, -sin], [sin, cos]] per
    (position, pair), applied to consecutive (interleaved) pairs by broadcast-multiply and sum."""

    def __init__(self, dim, ratio=10000.0, max_seq_len=128):
        super().__init__()
        freqs = 1.0 / (ratio ** (torch.arange(0, dim, 2, dtype=torch.float64)[: dim // 2] / dim))
        t = torch.arange(max_seq_len, dtype=torch.float64)
        freqs = torch.outer(t, freqs)
        cached = torch.stack([freqs.cos(), -freqs.sin(), freqs.sin(), freqs.cos()], dim=2)
        self.register_buffer("cached_freqs", cached.view(*freqs.shape, 2, 2), persistent=False)

    def adjusted_qk(self, q, k, position_ids, past_kv_state=None, use_cache=False):
        q_ = q.view(*q.size()[:-1], -1, 2)  # b, s, h, d/2, 2
        k_ = k.view(*k.size()[:-1], -1, 2)
        freqs = self.cached_freqs[position_ids][:, :, None].to(q.dtype)  # b, s, 1, d/2, 2, 2
        q_out = freqs[:, -q.size(1):].mul(q_.unsqueeze(-2)).sum(5).flatten(3)
        k_out = freqs[:, -k.size(1):].mul(k_.unsqueeze(-2)).sum(5).flatten(3)
        return q_out.type_as(q), k_out.type_as(k)

class UnfusedQKV(nn.Module):
    def __init__(self, emb_dim, nheads, kvheads, emb_kq_per_head, emb_v_per_head, use_bias):
        super().__init__()
        self.query = nn.Linear(emb_dim, nheads * emb_kq_per_head, bias=use_bias)
        self.key = nn.Linear(emb_dim, kvheads * emb_kq_per_head, bias=use_bias)
        self.value = nn.Linear(emb_dim, kvheads * emb_v_per_head, bias=use_bias)

    def forward(self, q, k, v):
        return self.query(q), self.key(k), self.value(v)

class MultiHeadAttention(nn.Module):
    """IBM foundation-model-stack style: emb_kq / emb_v per head are independent of emb_dim,
    the position encoder adjusts q/k (rotary) or the mask (ALiBi), SDPA does the rest."""

    def __init__(self, emb_dim, emb_kq, emb_v, nheads, kvheads, use_bias=False, position_encoder=None):
        super().__init__()
        self.nheads = nheads
        self.kvheads = kvheads
        self.emb_dim = emb_dim
        self.emb_kq_per_head = emb_kq
        self.emb_v_per_head = emb_v
        self.in_proj = UnfusedQKV(emb_dim, nheads, kvheads, emb_kq, emb_v, use_bias)
        self.dense = nn.Linear(nheads * emb_v, emb_dim, bias=use_bias)
        self.position_encoder = position_encoder

    def forward(self, q, k=None, v=None, mask=None, position_ids=None, past_key_value_state=None,
                use_cache=False, is_self=True, is_causal_mask=False):
        if k is None and v is None:
            k = v = q
        batch_size, q_len, _ = q.size()
        kv_len = k.size(1)
        q_out, k_out, v_out = self.in_proj(q, k, v)
        queries = q_out.view(batch_size, q_len, self.nheads, self.emb_kq_per_head)
        keys = k_out.view(batch_size, kv_len, self.kvheads, self.emb_kq_per_head)
        values = v_out.view(batch_size, kv_len, self.kvheads, self.emb_v_per_head)

        if self.position_encoder is not None:
            if position_ids is None:
                position_ids = torch.arange(q_len, device=q.device).unsqueeze(0).expand(batch_size, -1)
            queries, keys = self.position_encoder.adjusted_qk(
                queries, keys, position_ids, past_key_value_state, use_cache
            )

        queries = queries.transpose(2, 1)
        keys = keys.transpose(2, 1)
        values = values.transpose(2, 1)

        attn_mask = mask
        if self.position_encoder is not None and attn_mask is not None:
            attn_mask = self.position_encoder.adjusted_mask(
                attn_mask, queries, keys, past_key_value_state, use_cache
            )

        if self.nheads != self.kvheads:
            expansion = self.nheads // self.kvheads
            keys = keys.unsqueeze(2).expand(-1, -1, expansion, -1, -1).flatten(1, 2)
            values = values.unsqueeze(2).expand(-1, -1, expansion, -1, -1).flatten(1, 2)

        attn = F.scaled_dot_product_attention(
            queries,
            keys,
            values,
            attn_mask=attn_mask,
            dropout_p=0.0,
            is_causal=is_causal_mask and attn_mask is None,
        )
        attn = attn.transpose(2, 1).contiguous().view(batch_size, q_len, self.nheads * self.emb_v_per_head)
        return self.dense(attn)

class LLaMABlock(nn.Module):
    def __init__(self, rotary):
        super().__init__()
        self.attn = MultiHeadAttention(64, 8, 8, nheads=8, kvheads=4, use_bias=False, position_encoder=rotary)

class LLaMA(nn.Module):
    """fms LLaMA body: one shared RotaryEmbedding, causal through SDPA's is_causal (mask None)."""

    def __init__(self):
        super().__init__()
        self.rot_emb = RotaryEmbedding(8, ratio=10000.0, max_seq_len=128)
        self.layers = nn.ModuleList([LLaMABlock(self.rot_emb)])

    def forward(self, x):
        position_ids = torch.arange(x.size(1), device=x.device).unsqueeze(0).expand(x.size(0), -1)
        for layer in self.layers:
            x = layer.attn(x, mask=None, position_ids=position_ids, is_causal_mask=True)
        return x

def make_fms_llama():
    torch.manual_seed(1622)
    return LLaMA().eval()


EXPECT = {
    "target": "make_fms_llama",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "layers.0.attn",
    "structure": {
        "heads": 8,
        "kv_heads": 4,
        "head_dim": 8,
        "causal": True,
        "cross": False,
        "rope": {
            "pairing": "interleaved",
            "fraction": 1.0,
            "base": 10000
        },
        "qk_norm": None,
        "window": None,
        "bias": None
    },
    "style": "fms LLaMA MultiHeadAttention, RotaryEmbedding.adjusted_qk with cached 2x2 matrices, GQA 8:4 by expand: correct"
}

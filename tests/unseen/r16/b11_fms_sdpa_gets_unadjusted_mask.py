"""IBM foundation-model-stack (fms) `MultiHeadAttention`: `UnfusedQKV` query/key/value Linears with
per-head emb_kq/emb_v independent of emb_dim, a `position_encoder` that either adjusts q/k
(`RotaryEmbedding.adjusted_qk`, 2x2 rotation matrices on consecutive pairs) or the mask
(`Alibi.adjusted_mask`), GQA by unsqueeze/expand/flatten, SDPA, `dense` output.

This file: one bug: SDPA is handed the caller's `mask` instead of the ALiBi-adjusted `attn_mask`, so
the causal mask holds but no position bias is added."""

import math

import torch
import torch.nn.functional as F
from torch import nn

class PositionEncoder(nn.Module):
    def adjusted_qk(self, q, k, position_ids, past_kv_state=None, use_cache=False):
        return q, k

    def adjusted_mask(self, mask, q, k, past_kv_state=None, use_cache=False):
        return mask

def _get_slopes(n):
    def power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(n).is_integer():
        return power_of_2(n)
    closest = 2 ** math.floor(math.log2(n))
    return power_of_2(closest) + _get_slopes(2 * closest)[0::2][: n - closest]

class Alibi(PositionEncoder):
    def __init__(self, nheads, max_len=1024):
        super().__init__()
        self.register_buffer("slopes", torch.tensor(_get_slopes(nheads), dtype=torch.float64), persistent=False)

    def adjusted_mask(self, mask, q, k, past_kv_state=None, use_cache=False):
        q_len, k_len = q.size(-2), k.size(-2)
        q_pos = torch.arange(k_len - q_len, k_len, dtype=torch.float64, device=q.device)[:, None]
        k_pos = torch.arange(k_len, dtype=torch.float64, device=q.device)[None, :]
        rel = k_pos - q_pos  # <= 0 for the visible (past) keys
        bias = (self.slopes[:, None, None] * rel).to(q.dtype)
        return mask + bias.unsqueeze(0)

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
            attn_mask=mask,
            dropout_p=0.0,
            is_causal=is_causal_mask and attn_mask is None,
        )
        attn = attn.transpose(2, 1).contiguous().view(batch_size, q_len, self.nheads * self.emb_v_per_head)
        return self.dense(attn)

class GPTBigCodeLikeBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = MultiHeadAttention(64, 16, 16, nheads=6, kvheads=6, use_bias=True, position_encoder=Alibi(6))

class HeadlessDecoder(nn.Module):
    """fms decoder body: builds the additive causal mask; the ALiBi encoder adds its bias to it."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([GPTBigCodeLikeBlock()])

    def forward(self, x):
        n = x.size(1)
        mask = torch.zeros(n, n, dtype=x.dtype, device=x.device)
        mask = mask.masked_fill(torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        mask = mask[None, None].expand(x.size(0), 1, n, n)
        for layer in self.layers:
            x = layer.attn(x, mask=mask, is_causal_mask=False)
        return x

def make_fms_alibi():
    torch.manual_seed(1625)
    return HeadlessDecoder().eval()


EXPECT = {
    "target": "make_fms_alibi",
    "kind": "causal-multihead",
    "ok": False,
    "layer": "layers.0.attn",
    "stage": "biased_scores",
    "mistake": "bias_missing",
    "style": "fms MultiHeadAttention: scaled_dot_product_attention(attn_mask=mask) drops the ALiBi-adjusted attn_mask"
}

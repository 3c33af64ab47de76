"""facebookresearch/multimodal (TorchMultimodal) `MultiHeadAttentionWithCache`: separate
`q_proj`/`k_proj`/`v_proj` (dim_kv may differ from dim_q), an optional `past_key_value` cache, the
library's `scaled_dot_product_attention(q, k, v, attention_mask, head_mask, attn_dropout)` helper
(masked_fill(mask == 0, -inf)), `output_proj`, and a `MHAWithCacheOutput` NamedTuple; wrapped in a
pre-norm decoder half.

This file: one bug: the attention helper normalises with `torch.softmax(attn, dim=-2)`, over the
queries."""

import math
from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor, nn

class MHAWithCacheOutput(NamedTuple):
    attn_output: Tensor
    past_key_value: Optional[Tuple[Tensor, Tensor]] = None

def scaled_dot_product_attention(q, k, v, attention_mask=None, head_mask=None, attn_dropout=0.0):
    """torchmultimodal.modules.layers.attention style helper: (b, h, q, d) x (b, h, k, d)."""
    attn = torch.matmul(q, k.transpose(-1, -2))
    attn = attn / math.sqrt(q.shape[-1])
    if attention_mask is not None:
        attn = attn.masked_fill(attention_mask == 0, float("-inf"))
    attn = torch.softmax(attn, dim=-2)
    if head_mask is not None:
        attn = attn * head_mask
    return torch.matmul(attn, v)

class MultiHeadAttentionWithCache(nn.Module):
    """torchmultimodal MultiHeadAttentionWithCache: separate q/k/v projections (dim_kv may differ
    from dim_q for cross-attention), optional KV cache, output_proj."""

    def __init__(self, dim_q, dim_kv, num_heads, dropout=0.0, bias=True):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim_q // num_heads
        self.q_proj = nn.Linear(dim_q, dim_q, bias=bias)
        self.k_proj = nn.Linear(dim_kv, dim_q, bias=bias)
        self.v_proj = nn.Linear(dim_kv, dim_q, bias=bias)
        self.output_proj = nn.Linear(dim_q, dim_q)
        self.dropout = dropout

    def forward(self, query, key, value, attn_mask=None, past_key_value=None, is_causal=False, use_cache=False):
        bsz = query.size(0)
        q = self.q_proj(query).view(bsz, -1, self.num_heads, self.head_dim).transpose(1, 2)
        key = self.k_proj(key).view(bsz, -1, self.num_heads, self.head_dim).transpose(1, 2)
        value = self.v_proj(value).view(bsz, -1, self.num_heads, self.head_dim).transpose(1, 2)
        if past_key_value is not None:
            key = torch.cat([past_key_value[0], key], dim=2)
            value = torch.cat([past_key_value[1], value], dim=2)
        if use_cache:
            past_key_value = (key, value)
        if is_causal:
            q_len, k_len = q.size(2), key.size(2)
            causal = torch.ones(q_len, k_len, dtype=torch.bool, device=q.device).tril(k_len - q_len)
            attn_mask = causal[None, None] if attn_mask is None else attn_mask & causal
        attn = scaled_dot_product_attention(q, key, value, attention_mask=attn_mask,
                                            attn_dropout=self.dropout if self.training else 0.0)
        attn = attn.transpose(1, 2).reshape(bsz, -1, self.num_heads * self.head_dim)
        attn_output = self.output_proj(attn)
        return MHAWithCacheOutput(attn_output, past_key_value)

class TransformerCrossAttentionLayer(nn.Module):
    """Decoder half that attends from the text stream to an encoder's features (pre-norm)."""

    def __init__(self, d_model=64, dim_kv=48, n_head=4):
        super().__init__()
        self.cross_attention_layernorm = nn.LayerNorm(d_model)
        self.cross_attention = MultiHeadAttentionWithCache(d_model, dim_kv, n_head)

    def forward(self, hidden_states, encoder_hidden_states):
        x = self.cross_attention_layernorm(hidden_states)
        out = self.cross_attention(x, encoder_hidden_states, encoder_hidden_states)
        return out.attn_output

def make_tmm_cross_layer():
    torch.manual_seed(1643)
    layer = TransformerCrossAttentionLayer()
    with torch.no_grad():
        layer.cross_attention_layernorm.weight.uniform_(0.5, 1.5)
        layer.cross_attention_layernorm.bias.uniform_(-0.2, 0.2)
    return layer.eval()


EXPECT = {
    "target": "make_tmm_cross_layer",
    "kind": "cross",
    "ok": False,
    "layer": "cross_attention",
    "stage": "weights",
    "mistake": "softmax_wrong_dim",
    "style": "TorchMultimodal scaled_dot_product_attention helper: softmax over dim=-2 (queries) in cross-attention"
}

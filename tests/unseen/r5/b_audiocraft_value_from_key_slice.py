"""AudioCraft/MusicGen StreamingMultiheadAttention (custom path, not streaming); bug: values sliced from the key rows of in_proj_weight."""

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn


class StreamingMultiheadAttention(nn.Module):
    """Packed in_proj_weight (3 * embed_dim, embed_dim) laid out [q; k; v] like nn.MultiheadAttention."""

    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True, causal=False, custom=True):
        super().__init__()
        assert custom, "only the custom implementation is kept"
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.causal = causal
        self.custom = custom
        self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim)) if bias else None
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        nn.init.xavier_uniform_(self.in_proj_weight)
        if self.in_proj_bias is not None:
            nn.init.uniform_(self.in_proj_bias, -0.1, 0.1)
        self._streaming_state = {}

    def forward(self, query, key, value, key_padding_mask=None, need_weights=False, attn_mask=None):
        assert not need_weights and key_padding_mask is None
        dim = self.embed_dim
        if self.in_proj_bias is None:
            bias_q = bias_k = bias_v = None
        else:
            bias_q = self.in_proj_bias[:dim]
            bias_k = self.in_proj_bias[dim : 2 * dim]
            bias_v = self.in_proj_bias[2 * dim :]
        # slice the packed weight per input so that query, key and value may differ
        q = F.linear(query, self.in_proj_weight[:dim], bias_q)
        k = F.linear(key, self.in_proj_weight[dim : 2 * dim], bias_k)
        v = F.linear(value, self.in_proj_weight[dim : 2 * dim], bias_v)
        q, k, v = [rearrange(t, "b t (h d) -> b h t d", h=self.num_heads) for t in (q, k, v)]

        x = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=self.causal and attn_mask is None, dropout_p=0.0
        )
        x = rearrange(x, "b h t d -> b t (h d)")
        return self.out_proj(x), None


def make_attention():
    return StreamingMultiheadAttention(embed_dim=20, num_heads=4, causal=True, custom=True)


EXPECT = {
    "target": "make_attention",
    "kind": "causal-multihead",
    "ok": False,
    "stage": "values",
    "mistake": "wrong_projection",
    "style": "AudioCraft StreamingMultiheadAttention custom path used non-streaming (v from in_proj_weight[dim:2*dim])",
}

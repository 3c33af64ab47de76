"""LTX-Video transformer cross-attention (attn2), written from scratch without diffusers.

to_q on the 64-wide video tokens, to_k/to_v on 48-wide T5 caption states, qk_norm
"rms_norm_across_heads" (one RMSNorm over all heads' width, with a gain, on queries and on keys,
before the head split), no rotary on the cross path, SDPA, to_out Linear. The block adds the
result to the residual stream.
"""

import torch
import torch.nn.functional as F
from torch import nn


class LTXVideoAttention(nn.Module):
    def __init__(self, query_dim=64, cross_attention_dim=48, heads=4, dim_head=16, eps=1e-5):
        super().__init__()
        inner_dim = heads * dim_head
        self.heads = heads
        self.dim_head = dim_head
        self.to_q = nn.Linear(query_dim, inner_dim, bias=True)
        self.to_k = nn.Linear(cross_attention_dim, inner_dim, bias=True)
        self.to_v = nn.Linear(cross_attention_dim, inner_dim, bias=True)
        self.norm_q = nn.RMSNorm(inner_dim, eps=eps, elementwise_affine=True)
        self.norm_k = nn.RMSNorm(inner_dim, eps=eps, elementwise_affine=True)
        self.to_out = nn.ModuleList([nn.Linear(inner_dim, query_dim, bias=True), nn.Dropout(0.0)])

    def forward(self, hidden_states, encoder_hidden_states=None):
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        batch_size = hidden_states.shape[0]
        query = self.to_q(hidden_states)
        key = self.to_k(encoder_hidden_states)
        value = self.to_v(encoder_hidden_states)
        query = self.norm_q(query)
        key = self.norm_k(key)
        query = query.unflatten(2, (self.heads, -1)).transpose(1, 2)
        key = key.unflatten(2, (self.heads, -1)).transpose(1, 2)
        value = value.unflatten(2, (self.heads, -1)).transpose(1, 2)
        hidden_states = F.scaled_dot_product_attention(
            query, key, value, dropout_p=0.0, is_causal=False
        )
        hidden_states = hidden_states.transpose(1, 2).flatten(2, 3).to(query.dtype)
        hidden_states = self.to_out[0](hidden_states)
        return self.to_out[1](hidden_states)


class LTXVideoCrossBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn2 = LTXVideoAttention()

    def forward(self, hidden_states, encoder_hidden_states):
        return hidden_states + self.attn2(
            hidden_states, encoder_hidden_states=encoder_hidden_states
        )


def make_ltx_cross_block():
    torch.manual_seed(1012)
    block = LTXVideoCrossBlock()
    with torch.no_grad():
        block.attn2.norm_q.weight.uniform_(0.5, 1.5)
        block.attn2.norm_k.weight.uniform_(0.5, 1.5)
    return block.eval()


EXPECT = {
    "target": "make_ltx_cross_block",
    "kind": "cross",
    "ok": True,
    "layer": "attn2",
    "structure": {
        "heads": 4,
        "kv_heads": 4,
        "head_dim": 16,
        "causal": False,
        "cross": True,
        "rope": None,
        "qk_norm": "full",
        "window": None,
        "bias": None,
    },
    "style": "LTX-Video attn2 cross-attention: 64-wide queries, 48-wide caption keys/values, qk_norm rms_norm_across_heads "
    "(nn.RMSNorm over the 64-wide q and k before unflatten), SDPA, to_out ModuleList",
}

"""SigLIP2-style vision encoder layer with an einsum attention (as in JAX/Flax big_vision ports
to torch), written from scratch.

q/k/v/out Linear with bias; heads kept as (b, t, h, d) and never transposed: scores by
einsum('bqhd,bkhd->bhqk'), context by einsum('bhqk,bkhd->bqhd'); 6 heads of 8; non-causal;
pre-LayerNorm residual layer.
"""

import torch
from torch import nn


class Siglip2Attention(nn.Module):
    def __init__(self, embed_dim=48, num_heads=6):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scale = self.head_dim**-0.5
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, hidden_states, attention_mask=None):
        b, t, _ = hidden_states.shape
        q = self.q_proj(hidden_states).reshape(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(hidden_states).reshape(b, t, self.num_heads, self.head_dim)
        v = self.v_proj(hidden_states).reshape(b, t, self.num_heads, self.head_dim)
        attn_weights = torch.einsum("bqhd,bkhd->bhqk", q * self.scale, k)
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = attn_weights.softmax(dim=-1)
        attn_output = torch.einsum("bhqk,bkhd->bqhd", attn_weights, v)
        attn_output = attn_output.reshape(b, t, self.embed_dim)
        return self.out_proj(attn_output), attn_weights


class Siglip2EncoderLayer(nn.Module):
    def __init__(self, embed_dim=48, num_heads=6):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(embed_dim, eps=1e-6)
        self.self_attn = Siglip2Attention(embed_dim, num_heads)

    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states, _ = self.self_attn(self.layer_norm1(hidden_states))
        return residual + hidden_states


def make_siglip2_layer():
    torch.manual_seed(1011)
    layer = Siglip2EncoderLayer()
    with torch.no_grad():
        layer.layer_norm1.weight.uniform_(0.5, 1.5)
        layer.layer_norm1.bias.uniform_(-0.2, 0.2)
    return layer.eval()


EXPECT = {
    "target": "make_siglip2_layer",
    "kind": "multihead",
    "ok": True,
    "layer": "self_attn",
    "structure": {
        "heads": 6,
        "kv_heads": 6,
        "head_dim": 8,
        "causal": False,
        "cross": False,
        "rope": None,
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "SigLIP2-style encoder layer with a big_vision-like einsum attention: (b, t, h, d) never transposed, "
    "einsum('bqhd,bkhd->bhqk') on pre-scaled queries, einsum('bhqk,bkhd->bqhd') context, 6 heads of 8",
}

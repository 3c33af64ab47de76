"""Hugging Face Kosmos-2 text model style KosmosTextAttention (Magneto sub-LN): q_proj * scaling,
k/v projections, (bsz * heads) fold, bmm, causal additive mask, softmax, bmm, merge, then
inner_attn_ln, a LayerNorm over the merged heads, before out_proj. Pre-LN decoder block with a
finfo.min causal mask. Outside the vocabulary: the LayerNorm between the merged heads and the
output projection."""

import torch
from torch import nn


class KosmosTextAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, add_inner_attn_layernorm=True, bias=True):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim**-0.5
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.inner_attn_ln = nn.LayerNorm(embed_dim, eps=1e-5) if add_inner_attn_layernorm else None

    def _shape(self, projection):
        new_projection_shape = projection.size()[:-1] + (self.num_heads, self.head_dim)
        return projection.view(new_projection_shape).permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask=None):
        batch_size, seq_length = hidden_states.shape[:2]
        query_states = self._shape(self.q_proj(hidden_states) * self.scaling)
        key_states = self._shape(self.k_proj(hidden_states))
        value_states = self._shape(self.v_proj(hidden_states))
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3))
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.permute(0, 2, 1, 3).contiguous().view(batch_size, seq_length, -1)
        if self.inner_attn_ln is not None:
            attn_output = self.inner_attn_ln(attn_output)
        return self.out_proj(attn_output)


class Kosmos2TextBlock(nn.Module):
    def __init__(self, embed_dim=64, num_heads=4):
        super().__init__()
        self.self_attn_layer_norm = nn.LayerNorm(embed_dim)
        self.self_attn = KosmosTextAttention(embed_dim, num_heads)

    def forward(self, hidden_states):
        t = hidden_states.shape[1]
        mask = torch.full((t, t), torch.finfo(hidden_states.dtype).min, dtype=hidden_states.dtype)
        mask = torch.triu(mask, diagonal=1)[None, None]
        residual = hidden_states
        hidden_states = self.self_attn(
            self.self_attn_layer_norm(hidden_states), attention_mask=mask
        )
        return residual + hidden_states


def make_kosmos2_block():
    torch.manual_seed(1293)
    block = Kosmos2TextBlock()
    with torch.no_grad():
        for ln in (block.self_attn_layer_norm, block.self_attn.inner_attn_ln):
            ln.weight.uniform_(0.5, 1.5)
            ln.bias.uniform_(-0.2, 0.2)
    return block.eval()


EXPECT = {
    "target": "make_kosmos2_block",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "self_attn",
    "unsupported": "sub_layernorm",
    "style": "Kosmos-2 KosmosTextAttention with inner_attn_ln (Magneto sub-LN) between the merged "
    "heads and out_proj",
}

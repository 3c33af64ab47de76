"""IDEFICS (v1) style gated cross-attention where o_proj is only applied on the
self-attention path (`if not self.is_cross_attention`), so the cross-attention output
leaves without its output projection.
"""

import torch
from torch import nn


class IdeficsAttention(nn.Module):
    def __init__(
        self,
        hidden_size=64,
        num_heads=4,
        is_cross_attention=True,
        kv_input_dim=48,
        qk_layer_norms=True,
    ):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.is_cross_attention = is_cross_attention
        kv_in = kv_input_dim if is_cross_attention else hidden_size
        self.q_proj = nn.Linear(hidden_size, num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(kv_in, num_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(kv_in, num_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * self.head_dim, hidden_size, bias=False)
        self.qk_layer_norms = qk_layer_norms
        if qk_layer_norms:
            self.q_layer_norm = nn.LayerNorm(self.head_dim, eps=1e-5)
            self.k_layer_norm = nn.LayerNorm(self.head_dim, eps=1e-5)

    def forward(self, hidden_states, key_value_states=None, attention_mask=None):
        bsz, q_len, _ = hidden_states.size()
        kv_len = key_value_states.size(1)
        q = (
            self.q_proj(hidden_states)
            .view(bsz, q_len, self.num_heads, self.head_dim)
            .transpose(1, 2)
        )
        k = (
            self.k_proj(key_value_states)
            .view(bsz, kv_len, self.num_heads, self.head_dim)
            .transpose(1, 2)
        )
        v = (
            self.v_proj(key_value_states)
            .view(bsz, kv_len, self.num_heads, self.head_dim)
            .transpose(1, 2)
        )
        if self.qk_layer_norms:
            q = self.q_layer_norm(q)
            k = self.k_layer_norm(k)
        out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        out = out.transpose(1, 2).reshape(bsz, q_len, -1)
        if not self.is_cross_attention:
            out = self.o_proj(out)
        return out, None


class IdeficsGatedCrossAttentionLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.cross_attn = IdeficsAttention()
        self.input_layernorm = nn.LayerNorm(64)
        self.alpha_cross_attn = nn.Parameter(torch.full((1, 1, 64), 0.7))

    def forward(self, hidden_states, image_hidden_states):
        residual = hidden_states
        h = self.input_layernorm(hidden_states)
        h, _ = self.cross_attn(hidden_states=h, key_value_states=image_hidden_states)
        return residual + torch.tanh(self.alpha_cross_attn) * h


def make_gated_xattn():
    torch.manual_seed(17)
    layer = IdeficsGatedCrossAttentionLayer()
    with torch.no_grad():
        for n in (
            layer.input_layernorm,
            layer.cross_attn.q_layer_norm,
            layer.cross_attn.k_layer_norm,
        ):
            n.weight.copy_(torch.rand(n.weight.shape) + 0.4)
            n.bias.copy_(torch.rand(n.bias.shape) * 0.4 - 0.2)
    return layer


EXPECT = {
    "target": "make_gated_xattn",
    "kind": "cross",
    "ok": False,
    "layer": "cross_attn",
    "stage": "output",
    "mistake": "missing_out_proj",
    "style": "HF IDEFICS (v1) cross-attention with per-head qk LayerNorms: o_proj exists but is skipped on the "
    "cross-attention path",
}

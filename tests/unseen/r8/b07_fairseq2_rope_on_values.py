"""fairseq2 style self-attention with a ReferenceRotaryEncoder (complex-number rotary on
adjacent pairs, base 10000) and 6 query heads over 3 key/value heads; the position
encoder is applied to the values as well as to queries and keys (the three
`pos_encoder` lines were copy-pasted).
"""

import torch
import torch.nn.functional as F
from torch import nn


class ReferenceRotaryEncoder(nn.Module):
    def __init__(self, encoding_dim, max_seq_len=128, theta=10000.0):
        super().__init__()
        self.encoding_dim = encoding_dim
        freqs = 1.0 / theta ** (
            torch.arange(0, encoding_dim, 2, dtype=torch.float64) / encoding_dim
        )
        steps = torch.arange(max_seq_len, dtype=torch.float64)
        table = torch.outer(steps, freqs)
        self.register_buffer(
            "complex_freqs", torch.polar(torch.ones_like(table), table), persistent=False
        )

    def forward(self, seqs):
        # seqs: (N, S, H, K)
        s = seqs.size(1)
        c = torch.view_as_complex(seqs.double().reshape(*seqs.shape[:-1], -1, 2))
        c = c * self.complex_freqs[:s][None, :, None, :]
        return torch.view_as_real(c).flatten(-2).to(seqs.dtype)


class StandardMultiheadAttention(nn.Module):
    def __init__(self, model_dim=96, num_heads=6, num_key_value_heads=3):
        super().__init__()
        self.num_heads, self.num_key_value_heads = num_heads, num_key_value_heads
        self.head_dim = model_dim // num_heads
        self.q_proj = nn.Linear(model_dim, model_dim, bias=False)
        self.k_proj = nn.Linear(model_dim, self.head_dim * num_key_value_heads, bias=False)
        self.v_proj = nn.Linear(model_dim, self.head_dim * num_key_value_heads, bias=False)
        self.output_proj = nn.Linear(model_dim, model_dim, bias=False)
        self.pos_encoder = ReferenceRotaryEncoder(self.head_dim)

    def forward(self, seqs, keys, values):
        q = self.q_proj(seqs).unflatten(-1, (self.num_heads, -1))
        k = self.k_proj(keys).unflatten(-1, (self.num_key_value_heads, -1))
        v = self.v_proj(values).unflatten(-1, (self.num_key_value_heads, -1))
        q = self.pos_encoder(q)
        k = self.pos_encoder(k)
        v = self.pos_encoder(v)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        rep = self.num_heads // self.num_key_value_heads
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.output_proj(attn.transpose(1, 2).flatten(2, 3))


class StandardTransformerDecoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn_layer_norm = nn.LayerNorm(96)
        self.self_attn = StandardMultiheadAttention()

    def forward(self, seqs):
        residual = seqs
        seqs = self.self_attn_layer_norm(seqs)
        return residual + self.self_attn(seqs, keys=seqs, values=seqs)


def make_fairseq2_layer():
    torch.manual_seed(107)
    layer = StandardTransformerDecoderLayer()
    with torch.no_grad():
        layer.self_attn_layer_norm.weight.uniform_(0.5, 1.5)
    return layer


EXPECT = {
    "target": "make_fairseq2_layer",
    "kind": "causal-multihead",
    "ok": False,
    "layer": "self_attn",
    "stage": "values",
    "mistake": "rope_on_values",
    "style": "fairseq2 StandardMultiheadAttention with ReferenceRotaryEncoder (complex, adjacent pairs, GQA 6:3, "
    "SDPA is_causal): pos_encoder also applied to the values",
}

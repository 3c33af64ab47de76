"""fairseq2 style encoder-decoder attention: StandardMultiheadAttention-like module
with q_proj on the decoder states (model_dim 96), k_proj/v_proj on the encoder output
(kv_dim 64) producing 2 key/value heads shared by 6 query heads (groups of 3),
output_proj, SDPA; the decoder layer applies a pre-norm to the query side only.
"""

import torch
import torch.nn.functional as F
from torch import nn


class StandardMultiheadAttention(nn.Module):
    def __init__(self, model_dim, num_heads, kv_dim=None, num_key_value_heads=None):
        super().__init__()
        kv_dim = kv_dim or model_dim
        self.num_heads = num_heads
        self.num_key_value_heads = num_key_value_heads or num_heads
        self.head_dim = model_dim // num_heads
        self.q_proj = nn.Linear(model_dim, model_dim, bias=True)
        self.k_proj = nn.Linear(kv_dim, self.head_dim * self.num_key_value_heads, bias=True)
        self.v_proj = nn.Linear(kv_dim, self.head_dim * self.num_key_value_heads, bias=True)
        self.output_proj = nn.Linear(model_dim, model_dim, bias=True)

    def _project_q(self, seqs):
        q = self.q_proj(seqs)
        return q.unflatten(-1, (self.num_heads, -1)).transpose(1, 2)  # (N, H, S, K)

    def _project_kv(self, keys, values):
        k = self.k_proj(keys).unflatten(-1, (self.num_key_value_heads, -1)).transpose(1, 2)
        v = self.v_proj(values).unflatten(-1, (self.num_key_value_heads, -1)).transpose(1, 2)
        return k, v

    def forward(self, seqs, keys, values):
        q = self._project_q(seqs)
        k, v = self._project_kv(keys, values)
        if self.num_key_value_heads < self.num_heads:
            rep = self.num_heads // self.num_key_value_heads
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        attn = F.scaled_dot_product_attention(q, k, v)
        attn = attn.transpose(1, 2).flatten(2, 3)
        return self.output_proj(attn)


class DecoderLayerCross(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder_decoder_attn_layer_norm = nn.LayerNorm(96)
        self.encoder_decoder_attn = StandardMultiheadAttention(
            96, 6, kv_dim=64, num_key_value_heads=2
        )

    def forward(self, seqs, encoder_output):
        residual = seqs
        seqs = self.encoder_decoder_attn_layer_norm(seqs)
        seqs = self.encoder_decoder_attn(seqs, keys=encoder_output, values=encoder_output)
        return seqs + residual


def make_decoder_cross():
    torch.manual_seed(16)
    layer = DecoderLayerCross()
    with torch.no_grad():
        layer.encoder_decoder_attn_layer_norm.weight.uniform_(0.5, 1.5)
    return layer


EXPECT = {
    "target": "make_decoder_cross",
    "kind": "cross",
    "ok": True,
    "layer": "encoder_decoder_attn",
    "structure": {
        "heads": 6,
        "kv_heads": 2,
        "head_dim": 16,
        "causal": False,
        "cross": True,
        "rope": None,
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "fairseq2 StandardMultiheadAttention as encoder-decoder attention: kv_dim 64 != model_dim 96, "
    "num_key_value_heads 2 for 6 heads (repeat_interleave), unflatten/transpose head layout, output_proj",
}

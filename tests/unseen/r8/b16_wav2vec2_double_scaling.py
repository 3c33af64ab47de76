"""Wav2Vec2 / HuBERT encoder layer (post-norm) whose attention was moved to SDPA: the
query is still multiplied by self.scaling after q_proj, as the eager code did, and
SDPA then applies its own default 1/sqrt(head_dim), so the scores are scaled twice
(1/head_dim overall).
"""

import torch
import torch.nn.functional as F
from torch import nn


class Wav2Vec2SdpaAttention(nn.Module):
    def __init__(self, embed_dim=32, num_heads=4):
        super().__init__()
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim**-0.5
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=True)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=True)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=True)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=True)

    def _shape(self, t, seq_len, bsz):
        return t.view(bsz, seq_len, self.num_heads, self.head_dim).transpose(1, 2).contiguous()

    def forward(self, hidden_states, attention_mask=None):
        bsz, tgt_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states) * self.scaling
        key_states = self._shape(self.k_proj(hidden_states), -1, bsz)
        value_states = self._shape(self.v_proj(hidden_states), -1, bsz)
        query_states = self._shape(query_states, tgt_len, bsz)
        attn_output = F.scaled_dot_product_attention(
            query_states, key_states, value_states, attn_mask=attention_mask
        )
        attn_output = attn_output.transpose(1, 2).reshape(bsz, tgt_len, self.embed_dim)
        return self.out_proj(attn_output), None, None


class Wav2Vec2EncoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = Wav2Vec2SdpaAttention()
        self.dropout = nn.Dropout(0.0)
        self.layer_norm = nn.LayerNorm(32, eps=1e-5)

    def forward(self, hidden_states):
        attn_residual = hidden_states
        hidden_states, _, _ = self.attention(hidden_states)
        hidden_states = self.dropout(hidden_states)
        return self.layer_norm(attn_residual + hidden_states)


def make_wav2vec2_layer():
    torch.manual_seed(116)
    layer = Wav2Vec2EncoderLayer()
    with torch.no_grad():
        layer.layer_norm.weight.uniform_(0.5, 1.5)
    return layer


EXPECT = {
    "target": "make_wav2vec2_layer",
    "kind": "multihead",
    "ok": False,
    "layer": "attention",
    "stage": "scaled_scores",
    "mistake": "wrong_scale",
    "style": "HF Wav2Vec2/HuBERT post-norm encoder layer ported to SDPA: q_proj(x) * scaling kept, and SDPA scales "
    "again, 1/8 instead of 1/sqrt(8)",
}

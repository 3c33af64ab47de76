"""SigLIP vision encoder layer: pre-norm LayerNorm, SiglipAttention with biased
q/k/v/out_proj, scale head_dim ** -0.5, non-causal, eager attention over all patches.
"""

import torch
from torch import nn


class SiglipAttention(nn.Module):
    def __init__(self, embed_dim=64, num_heads=4):
        super().__init__()
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.head_dim = embed_dim // num_heads
        self.scale = self.head_dim**-0.5
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, hidden_states, attention_mask=None):
        batch_size, seq_length, embed_dim = hidden_states.shape
        queries = self.q_proj(hidden_states)
        keys = self.k_proj(hidden_states)
        values = self.v_proj(hidden_states)
        queries = queries.view(batch_size, seq_length, self.num_heads, self.head_dim).transpose(
            1, 2
        )
        keys = keys.view(batch_size, seq_length, self.num_heads, self.head_dim).transpose(1, 2)
        values = values.view(batch_size, seq_length, self.num_heads, self.head_dim).transpose(1, 2)
        attn_weights = torch.matmul(queries, keys.transpose(2, 3)) * self.scale
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, values)
        attn_output = attn_output.transpose(1, 2).contiguous()
        attn_output = attn_output.reshape(batch_size, seq_length, embed_dim)
        return self.out_proj(attn_output), attn_weights


class SiglipEncoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(64, eps=1e-6)
        self.self_attn = SiglipAttention()

    def forward(self, hidden_states):
        residual = hidden_states
        h, _ = self.self_attn(self.layer_norm1(hidden_states))
        return residual + h


def make_siglip_layer():
    torch.manual_seed(18)
    layer = SiglipEncoderLayer()
    with torch.no_grad():
        layer.layer_norm1.weight.uniform_(0.5, 1.5)
    return layer


EXPECT = {
    "target": "make_siglip_layer",
    "kind": "multihead",
    "ok": True,
    "layer": "self_attn",
    "structure": {
        "heads": 4,
        "kv_heads": 4,
        "head_dim": 16,
        "causal": False,
        "cross": False,
        "rope": None,
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "HF SigLIP vision encoder layer: biased q/k/v/out_proj, eager softmax(QK^T * head_dim^-0.5), "
    "transpose + reshape merge, pre-norm residual",
}

"""DETR-family transformer decoder cross-attention through nn.MultiheadAttention with kdim/vdim,
written from scratch.

Object queries (64 wide) attend to a 48-wide flattened image memory; nn.MultiheadAttention
(embed_dim=64, num_heads=8, kdim=48, vdim=48, batch_first=True) therefore keeps separate
q/k/v projection weights (q_proj_weight, k_proj_weight, v_proj_weight) and one in_proj_bias.
Post-norm residual as in DETR (normalize_before=False); no positional embeddings here.
"""

import torch
from torch import nn


class CrossAttnDecoderLayer(nn.Module):
    def __init__(self, d_model=64, nhead=8, memory_dim=48):
        super().__init__()
        self.multihead_attn = nn.MultiheadAttention(
            d_model, nhead, dropout=0.0, kdim=memory_dim, vdim=memory_dim, batch_first=True
        )
        self.norm2 = nn.LayerNorm(d_model)

    def forward(self, tgt, memory):
        tgt2 = self.multihead_attn(query=tgt, key=memory, value=memory, need_weights=False)[0]
        return self.norm2(tgt + tgt2)


def make_detr_cross_layer():
    torch.manual_seed(1015)
    layer = CrossAttnDecoderLayer()
    with torch.no_grad():
        layer.multihead_attn.in_proj_bias.uniform_(-0.1, 0.1)
        layer.multihead_attn.out_proj.bias.uniform_(-0.1, 0.1)
        layer.norm2.weight.uniform_(0.5, 1.5)
        layer.norm2.bias.uniform_(-0.2, 0.2)
    return layer.eval()


EXPECT = {
    "target": "make_detr_cross_layer",
    "kind": "cross",
    "ok": True,
    "layer": "multihead_attn",
    "structure": {
        "heads": 8,
        "kv_heads": 8,
        "head_dim": 8,
        "causal": False,
        "cross": True,
        "rope": None,
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "DETR-family decoder cross-attention: nn.MultiheadAttention(64, 8, kdim=48, vdim=48, batch_first=True) called with "
    "query=/key=/value= keywords (separate q/k/v proj weights), post-norm residual",
}

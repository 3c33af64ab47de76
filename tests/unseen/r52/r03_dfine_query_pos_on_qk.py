"""D-FINE (Peterande) decoder layer, self-attention half: the object queries attend to each other
through nn.MultiheadAttention (batch_first), with the query position embedding added to the
queries and keys but not to the values (q = k = with_pos_embed(target, query_pos_embed),
value = target), post-norm residual (norm1). The position embedding here is a learned table over
the query slots (D-FINE derives it from the reference boxes through query_pos_head).

This file: refused: the decoder self-attention adds the query position embedding to the queries and keys only (q = k = target + query_pos, value = target)."""

import torch
from torch import nn


class DFineDecoderSelfLayer(nn.Module):
    def __init__(self, d_model=64, n_head=4, num_queries=64):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(d_model, n_head, batch_first=True)
        self.query_pos = nn.Embedding(num_queries, d_model)
        self.norm1 = nn.LayerNorm(d_model)

    @staticmethod
    def with_pos_embed(tensor, pos):
        return tensor if pos is None else tensor + pos

    def forward(self, target):
        n = target.shape[1]
        pos = self.query_pos.weight[:n].to(target.dtype)[None]
        q = k = self.with_pos_embed(target, pos)
        target2, _ = self.self_attn(q, k, value=target, need_weights=False)
        return self.norm1(target + target2)


def make_dfine_self_layer():
    torch.manual_seed(5233)
    layer = DFineDecoderSelfLayer()
    with torch.no_grad():
        layer.self_attn.in_proj_bias.uniform_(-0.2, 0.2)
        layer.self_attn.out_proj.bias.uniform_(-0.2, 0.2)
        layer.norm1.weight.uniform_(0.5, 1.5)
        layer.norm1.bias.uniform_(-0.2, 0.2)
    return layer.eval()


EXPECT = {
    "target": "make_dfine_self_layer",
    "kind": "multihead",
    "ok": True,
    "layer": "self_attn",
    "unsupported": "query_key_position_embedding",
    "style": "D-FINE (Peterande) decoder self-attention: refused: the decoder self-attention adds the query position embedding to the queries and keys only (q = k = target + query_pos, value = target)",
}

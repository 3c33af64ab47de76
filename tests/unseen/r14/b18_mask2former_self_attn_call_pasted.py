"""Mask2Former CrossAttentionLayer (post-norm) in a query-decoder wrapper: object queries attend to
pixel features through nn.MultiheadAttention run sequence-first (Q, B, C) / (HW, B, C), with
with_pos_embed helpers (positions None here), then an FFN layer and the decoder norm.

This file: one bug, the self-attention call was pasted into the cross-attention layer."""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class CrossAttentionLayer(nn.Module):
    def __init__(self, d_model, nhead, dropout=0.0, activation="relu", normalize_before=False):
        super().__init__()
        self.multihead_attn = nn.MultiheadAttention(d_model, nhead, dropout=dropout)
        self.norm = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)
        self.normalize_before = normalize_before

    def with_pos_embed(self, tensor, pos: Optional[Tensor]):
        return tensor if pos is None else tensor + pos

    def forward_post(
        self,
        tgt,
        memory,
        memory_mask: Optional[Tensor] = None,
        memory_key_padding_mask: Optional[Tensor] = None,
        pos: Optional[Tensor] = None,
        query_pos: Optional[Tensor] = None,
    ):
        q = k = self.with_pos_embed(tgt, query_pos)  # copied from SelfAttentionLayer.forward_post
        tgt2 = self.multihead_attn(
            q, k, value=tgt, attn_mask=memory_mask, key_padding_mask=memory_key_padding_mask
        )[0]
        tgt = tgt + self.dropout(tgt2)
        tgt = self.norm(tgt)
        return tgt

    def forward_pre(
        self,
        tgt,
        memory,
        memory_mask: Optional[Tensor] = None,
        memory_key_padding_mask: Optional[Tensor] = None,
        pos: Optional[Tensor] = None,
        query_pos: Optional[Tensor] = None,
    ):
        tgt2 = self.norm(tgt)
        tgt2 = self.multihead_attn(
            query=self.with_pos_embed(tgt2, query_pos),
            key=self.with_pos_embed(memory, pos),
            value=memory,
            attn_mask=memory_mask,
            key_padding_mask=memory_key_padding_mask,
        )[0]
        tgt = tgt + self.dropout(tgt2)
        return tgt

    def forward(
        self,
        tgt,
        memory,
        memory_mask: Optional[Tensor] = None,
        memory_key_padding_mask: Optional[Tensor] = None,
        pos: Optional[Tensor] = None,
        query_pos: Optional[Tensor] = None,
    ):
        if self.normalize_before:
            return self.forward_pre(
                tgt, memory, memory_mask, memory_key_padding_mask, pos, query_pos
            )
        return self.forward_post(tgt, memory, memory_mask, memory_key_padding_mask, pos, query_pos)


class FFNLayer(nn.Module):
    def __init__(self, d_model, dim_feedforward=256, dropout=0.0, normalize_before=False):
        super().__init__()
        self.linear1 = nn.Linear(d_model, dim_feedforward)
        self.dropout = nn.Dropout(dropout)
        self.linear2 = nn.Linear(dim_feedforward, d_model)
        self.norm = nn.LayerNorm(d_model)
        self.normalize_before = normalize_before

    def forward(self, tgt):
        tgt2 = self.linear2(self.dropout(F.relu(self.linear1(tgt))))
        tgt = tgt + self.dropout(tgt2)
        return self.norm(tgt)


class QueryDecoderLite(nn.Module):
    """The cross-attention half of a Mask2Former-style decoder: object queries attend to pixel features.

    Takes batch-first (queries, memory) and runs the layers sequence-first, as Mask2Former does."""

    def __init__(self, hidden_dim=64, nheads=4, dec_layers=1):
        super().__init__()
        self.transformer_cross_attention_layers = nn.ModuleList()
        self.transformer_ffn_layers = nn.ModuleList()
        for _ in range(dec_layers):
            self.transformer_cross_attention_layers.append(CrossAttentionLayer(hidden_dim, nheads))
            self.transformer_ffn_layers.append(FFNLayer(hidden_dim))
        self.decoder_norm = nn.LayerNorm(hidden_dim)

    def forward(self, queries, memory):
        output = queries.transpose(0, 1)  # (Q, B, C)
        src = memory.transpose(0, 1)  # (HW, B, C)
        for i in range(len(self.transformer_cross_attention_layers)):
            output = self.transformer_cross_attention_layers[i](
                output,
                src,
                memory_mask=None,
                memory_key_padding_mask=None,
                pos=None,
                query_pos=None,
            )
            output = self.transformer_ffn_layers[i](output)
        return self.decoder_norm(output).transpose(0, 1)


def make_query_decoder():
    torch.manual_seed(1451)
    model = QueryDecoderLite()
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.MultiheadAttention):
                mod.in_proj_bias.normal_(0.0, 0.1)
                mod.out_proj.bias.normal_(0.0, 0.1)
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.6, 1.4)
                mod.bias.normal_(0.0, 0.1)
    return model.eval()


EXPECT = {
    "target": "make_query_decoder",
    "kind": "cross",
    "ok": False,
    "layer": "transformer_cross_attention_layers.0.multihead_attn",
    "stage": "keys",
    "mistake": "wrong_source",
    "style": "Mask2Former CrossAttentionLayer: 'q = k = with_pos_embed(tgt, query_pos)' and value=tgt "
    "pasted from SelfAttentionLayer, so keys and values come from the queries",
}

"""WavLM (microsoft/unilm wavlm/modules.py MultiheadAttention, fairseq-derived): time-major
(T, B, C) layout, q_proj/k_proj/v_proj/out_proj, q scaled by head_dim ** -0.5 before the bmm over
(B * heads, T, head_dim), relative_attention_bias = nn.Embedding(num_buckets, heads) looked up by a
bidirectional log-bucketed relative position (compute_bias / _relative_positions_bucket), and the
gated relative position bias (gru_rel_pos): grep_linear on each head's slice of the layer input gives
gate_a, gate_b; gate_a * (gate_b * grep_a - 1) + 2 scales the bucket bias per query. Post-norm
TransformerSentenceEncoderLayer (layer_norm_first False); the first layer's position bias is handed on.

This file: refused: the relative position bias is multiplied by a per-query, per-head gate computed
from the query token's content (gated relative position bias)."""

import math

import torch
import torch.nn.functional as F
from torch import nn


class MultiheadAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, self_attention=True, has_relative_attention_bias=False,
                 num_buckets=32, max_distance=128, gru_rel_pos=False):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim**-0.5
        self.self_attention = self_attention
        self.has_relative_attention_bias = has_relative_attention_bias
        self.num_buckets = num_buckets
        self.max_distance = max_distance
        if self.has_relative_attention_bias:
            self.relative_attention_bias = nn.Embedding(num_buckets, num_heads)
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=True)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=True)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=True)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=True)
        self.gru_rel_pos = gru_rel_pos
        if self.gru_rel_pos:
            self.grep_linear = nn.Linear(self.head_dim, 8)
            self.grep_a = nn.Parameter(torch.ones(1, num_heads, 1, 1))

    def _relative_positions_bucket(self, relative_positions, bidirectional=True):
        num_buckets = self.num_buckets
        max_distance = self.max_distance
        relative_buckets = 0
        if bidirectional:
            num_buckets = num_buckets // 2
            relative_buckets += (relative_positions > 0).to(torch.long) * num_buckets
            relative_positions = torch.abs(relative_positions)
        else:
            relative_positions = -torch.min(relative_positions, torch.zeros_like(relative_positions))
        max_exact = num_buckets // 2
        is_small = relative_positions < max_exact
        relative_postion_if_large = max_exact + (
            torch.log(relative_positions.float().clamp(min=1) / max_exact)
            / math.log(max_distance / max_exact)
            * (num_buckets - max_exact)
        ).to(torch.long)
        relative_postion_if_large = torch.min(
            relative_postion_if_large, torch.full_like(relative_postion_if_large, num_buckets - 1)
        )
        relative_buckets += torch.where(is_small, relative_positions, relative_postion_if_large)
        return relative_buckets

    def compute_bias(self, query_length, key_length, device):
        context_position = torch.arange(query_length, dtype=torch.long, device=device)[:, None]
        memory_position = torch.arange(key_length, dtype=torch.long, device=device)[None, :]
        relative_position = memory_position - context_position
        relative_position_bucket = self._relative_positions_bucket(relative_position, bidirectional=True)
        values = self.relative_attention_bias(relative_position_bucket)
        return values.permute([2, 0, 1])  # heads, qlen, klen

    def forward(self, query, key, value, position_bias=None):
        tgt_len, bsz, embed_dim = query.size()
        src_len = tgt_len
        if self.has_relative_attention_bias and position_bias is None:
            position_bias = self.compute_bias(tgt_len, src_len, query.device)
            position_bias = position_bias.unsqueeze(0).repeat(bsz, 1, 1, 1).view(
                bsz * self.num_heads, tgt_len, src_len
            )

        attn_mask_rel_pos = position_bias
        if self.gru_rel_pos:
            query_layer = query.transpose(0, 1)
            new_x_shape = query_layer.size()[:-1] + (self.num_heads, -1)
            query_layer = query_layer.view(*new_x_shape).permute(0, 2, 1, 3)
            _B, _H, _L, __ = query_layer.size()
            gate_a, gate_b = torch.sigmoid(
                self.grep_linear(query_layer).view(_B, _H, _L, 2, 4).sum(-1, keepdim=False)
            ).chunk(2, dim=-1)
            gate_a_1 = gate_a * (gate_b * self.grep_a - 1.0) + 2.0
            attn_mask_rel_pos = gate_a_1.view(bsz * self.num_heads, -1, 1) * position_bias

        q = self.q_proj(query) * self.scaling
        k = self.k_proj(key)
        v = self.v_proj(value)
        q = q.contiguous().view(tgt_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        k = k.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        v = v.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)

        attn_weights = torch.bmm(q, k.transpose(1, 2))
        if attn_mask_rel_pos is not None:
            attn_weights = attn_weights + attn_mask_rel_pos.to(attn_weights.dtype)
        attn_weights_float = F.softmax(attn_weights, dim=-1)
        attn_probs = attn_weights_float.type_as(attn_weights)
        attn = torch.bmm(attn_probs, v)
        attn = attn.transpose(0, 1).contiguous().view(tgt_len, bsz, embed_dim)
        return self.out_proj(attn), position_bias


class TransformerSentenceEncoderLayer(nn.Module):
    def __init__(self, embedding_dim=64, ffn_embedding_dim=128, num_attention_heads=4,
                 has_relative_attention_bias=False, num_buckets=32, max_distance=128, gru_rel_pos=True):
        super().__init__()
        self.self_attn = MultiheadAttention(
            embedding_dim, num_attention_heads, self_attention=True,
            has_relative_attention_bias=has_relative_attention_bias, num_buckets=num_buckets,
            max_distance=max_distance, gru_rel_pos=gru_rel_pos,
        )
        self.self_attn_layer_norm = nn.LayerNorm(embedding_dim)
        self.fc1 = nn.Linear(embedding_dim, ffn_embedding_dim)
        self.fc2 = nn.Linear(ffn_embedding_dim, embedding_dim)
        self.final_layer_norm = nn.LayerNorm(embedding_dim)

    def forward(self, x, pos_bias=None):
        residual = x
        x, pos_bias = self.self_attn(query=x, key=x, value=x, position_bias=pos_bias)
        x = self.self_attn_layer_norm(residual + x)
        residual = x
        x = self.fc2(F.gelu(self.fc1(x)))
        x = self.final_layer_norm(residual + x)
        return x, pos_bias


class TransformerEncoder(nn.Module):
    def __init__(self, embedding_dim=64, num_layers=1):
        super().__init__()
        self.layers = nn.ModuleList([
            TransformerSentenceEncoderLayer(embedding_dim, has_relative_attention_bias=(i == 0),
                                            num_buckets=32, max_distance=128, gru_rel_pos=True)
            for i in range(num_layers)
        ])
        self.layer_norm = nn.LayerNorm(embedding_dim)

    def forward(self, x):
        # (B, T, C) -> (T, B, C); the convolutional relative position embedding is left out
        x = self.layer_norm(x)
        x = x.transpose(0, 1)
        pos_bias = None
        for layer in self.layers:
            x, pos_bias = layer(x, pos_bias=pos_bias)
        return x.transpose(0, 1)


def make_wavlm_encoder():
    torch.manual_seed(3702)
    model = TransformerEncoder()
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
        for layer in model.layers:
            layer.self_attn.grep_a.uniform_(0.5, 1.5)
            layer.self_attn.relative_attention_bias.weight.uniform_(-1.0, 1.0)
    return model.eval()


EXPECT = {
    "target": "make_wavlm_encoder",
    "kind": "multihead",
    "ok": True,
    "layer": "layers.0.self_attn",
    "unsupported": "gated_rel_pos_bias",
    "style": "WavLM MultiheadAttention (microsoft/unilm wavlm/modules.py): refused: gated relative position "
    "bias: bucketed bidirectional relative_attention_bias (32 buckets) scaled per query and head by "
    "gate_a * (gate_b * grep_a - 1) + 2 from grep_linear on the layer input; (T, B, C) layout, 4 heads of 16",
}

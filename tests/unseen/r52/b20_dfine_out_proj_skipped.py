"""D-FINE (Peterande) decoder layer, cross-attention half: object queries attend to the flattened
encoder memory. D-FINE's own cross-attention is the deformable sampler (MSDeformableAttention);
this layer is the dense variant kept for ablations, written like its nn.MultiheadAttention
self-attention: packed in_proj_weight/in_proj_bias (q, k, v rows), biased out_proj, batch-first,
eager softmax, post-norm residual (norm2) and the FFN after it.

This file: one bug: the merged heads are returned without out_proj (built, never applied)."""

import math

import torch
import torch.nn.functional as F
from torch import nn


class DenseCrossAttention(nn.Module):
    def __init__(self, embed_dim, num_heads):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim))
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        nn.init.xavier_uniform_(self.in_proj_weight)
        nn.init.uniform_(self.in_proj_bias, -0.2, 0.2)
        nn.init.uniform_(self.out_proj.bias, -0.2, 0.2)

    def forward(self, query, memory=None):
        memory = query if memory is None else memory
        w_q, w_k, w_v = self.in_proj_weight.chunk(3)
        b_q, b_k, b_v = self.in_proj_bias.chunk(3)
        q = F.linear(query, w_q, b_q)
        k = F.linear(memory, w_k, b_k)
        v = F.linear(memory, w_v, b_v)
        bs, n_q, _ = q.shape
        n_k = k.shape[1]
        q = q.view(bs, n_q, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(bs, n_k, self.num_heads, self.head_dim).transpose(1, 2)
        v = v.view(bs, n_k, self.num_heads, self.head_dim).transpose(1, 2)
        attn = torch.matmul(q, k.transpose(-2, -1)) * (self.head_dim ** -0.5)
        attn = attn.softmax(dim=-1)
        out = torch.matmul(attn, v)
        out = out.transpose(1, 2).reshape(bs, n_q, self.embed_dim)
        return out


class DFineDecoderCrossLayer(nn.Module):
    def __init__(self, d_model=64, n_head=8, dim_feedforward=128):
        super().__init__()
        self.cross_attn = DenseCrossAttention(d_model, n_head)
        self.norm2 = nn.LayerNorm(d_model)
        self.linear1 = nn.Linear(d_model, dim_feedforward)
        self.linear2 = nn.Linear(dim_feedforward, d_model)
        self.norm3 = nn.LayerNorm(d_model)

    def forward(self, target, memory):
        target = self.norm2(target + self.cross_attn(target, memory))
        return self.norm3(target + self.linear2(F.relu(self.linear1(target))))


def make_dfine_cross_layer():
    torch.manual_seed(5208)
    layer = DFineDecoderCrossLayer()
    with torch.no_grad():
        for mod in layer.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
    return layer.eval()


EXPECT = {
    "target": "make_dfine_cross_layer",
    "kind": "cross",
    "ok": False,
    "layer": "cross_attn",
    "stage": "output",
    "mistake": "missing_out_proj",
    "style": "D-FINE (Peterande) dense decoder cross-attention: one bug: the merged heads are returned without out_proj (built, never applied) (twin: c08)",
}

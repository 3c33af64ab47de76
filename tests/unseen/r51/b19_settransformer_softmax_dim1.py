"""Set Transformer (Juho Lee et al., juho-lee/set_transformer) multihead attention block, MAB:
fc_q / fc_k / fc_v (biased nn.Linear), heads cut by splitting the feature axis into dim_V // num_heads
chunks and stacking them on the batch axis (torch.cat(X.split(dim_split, 2), 0)), bmm scores,
softmax over keys, heads merged back by splitting the batch axis and concatenating features.
Written here in the "clean" form many forks use: 1/sqrt(head size) scale, an output projection
fc_o, and the residual/LayerNorm/rFF of the MAB outside the attention module.
This file: a MAB between two sets, MAB(X, Y), 8 heads of 8; the target takes (hidden, context) = (X, Y).

This file: one bug: torch.softmax(..., 1) on the (B*heads, |X|, |Y|) scores: normalised over the queries of X instead of the keys of Y"""

import math

import torch
from torch import nn
import torch.nn.functional as F


class MultiheadDotAttention(nn.Module):
    def __init__(self, dim_Q, dim_K, dim_V, num_heads):
        super().__init__()
        self.dim_V = dim_V
        self.num_heads = num_heads
        self.fc_q = nn.Linear(dim_Q, dim_V)
        self.fc_k = nn.Linear(dim_K, dim_V)
        self.fc_v = nn.Linear(dim_K, dim_V)
        self.fc_o = nn.Linear(dim_V, dim_V)

    def forward(self, Q, K):
        Q = self.fc_q(Q)
        K, V = self.fc_k(K), self.fc_v(K)
        dim_split = self.dim_V // self.num_heads
        Q_ = torch.cat(Q.split(dim_split, 2), 0)
        K_ = torch.cat(K.split(dim_split, 2), 0)
        V_ = torch.cat(V.split(dim_split, 2), 0)
        A = torch.softmax(Q_.bmm(K_.transpose(1, 2)) / math.sqrt(dim_split), 1)
        O = torch.cat(A.bmm(V_).split(Q.size(0), 0), 2)
        return self.fc_o(O)


class MAB(nn.Module):
    def __init__(self, dim_Q, dim_K, dim_V, num_heads, ln=True):
        super().__init__()
        self.attn = MultiheadDotAttention(dim_Q, dim_K, dim_V, num_heads)
        self.ln0 = nn.LayerNorm(dim_V) if ln else nn.Identity()
        self.ln1 = nn.LayerNorm(dim_V) if ln else nn.Identity()
        self.rff = nn.Linear(dim_V, dim_V)

    def forward(self, X, Y):
        H = self.ln0(X + self.attn(X, Y))
        return self.ln1(H + F.relu(self.rff(H)))


class CrossSetBlock(nn.Module):
    """MAB(X, Y): the elements of set X attend to the elements of set Y (any sizes)."""

    def __init__(self, dim=64, num_heads=8):
        super().__init__()
        self.mab = MAB(dim, dim, dim, num_heads)

    def forward(self, X, Y):
        return self.mab(X, Y)


def init_layernorms(model):
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
            elif isinstance(mod, nn.Linear) and mod.bias is not None:
                mod.bias.uniform_(-0.2, 0.2)


def make_set_transformer_mab():
    torch.manual_seed(5109)
    model = CrossSetBlock(dim=64, num_heads=8)
    init_layernorms(model)
    return model.eval()


EXPECT = {
    "target": "make_set_transformer_mab",
    "kind": "cross",
    "ok": False,
    "layer": "mab.attn",
    "stage": "weights",
    "mistake": "softmax_wrong_dim",
    "style": "Set Transformer (juho-lee) MAB: one bug: torch.softmax(..., 1) on the (B*heads, |X|, "
    "|Y|) scores: normalised over the queries of X instead of the keys of Y",
}

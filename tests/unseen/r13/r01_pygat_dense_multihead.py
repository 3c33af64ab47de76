"""pyGAT (Diego999/pyGAT) GraphAttentionLayer, batched over graphs, as a dense multi-head GAT layer
on node features (nodes as tokens): Wh = h @ W, e_ij = LeakyReLU(a_1 . Wh_i + a_2 . Wh_j) (additive
attention, not a dot product), where(adj > 0, e, -9e15) with the fully connected adjacency the encoder
builds, softmax over neighbours, attention @ Wh, ELU; heads concatenated and mixed by out_proj.

This file: refused (additive GAT scoring is outside the vocabulary)."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class GraphAttentionLayer(nn.Module):
    def __init__(self, in_features, out_features, alpha=0.2, concat=True):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.alpha = alpha
        self.concat = concat
        self.W = nn.Parameter(torch.empty(size=(in_features, out_features)))
        nn.init.xavier_uniform_(self.W.data, gain=1.414)
        self.a = nn.Parameter(torch.empty(size=(2 * out_features, 1)))
        nn.init.xavier_uniform_(self.a.data, gain=1.414)
        self.leakyrelu = nn.LeakyReLU(self.alpha)

    def _prepare_attentional_mechanism_input(self, Wh):
        Wh1 = torch.matmul(Wh, self.a[: self.out_features, :].to(Wh.dtype))
        Wh2 = torch.matmul(Wh, self.a[self.out_features :, :].to(Wh.dtype))
        # broadcast add: (B, N, 1) + (B, 1, N)
        e = Wh1 + Wh2.transpose(-1, -2)
        return self.leakyrelu(e)

    def forward(self, h, adj):
        Wh = torch.matmul(h, self.W.to(h.dtype))  # (B, N, out_features)
        e = self._prepare_attentional_mechanism_input(Wh)
        zero_vec = -9e15 * torch.ones_like(e)
        attention = torch.where(adj > 0, e, zero_vec)
        attention = F.softmax(attention, dim=-1)
        h_prime = torch.matmul(attention, Wh)
        return F.elu(h_prime) if self.concat else h_prime


class MultiHeadGAT(nn.Module):
    def __init__(self, nfeat=64, nhid=16, nheads=4):
        super().__init__()
        self.attentions = nn.ModuleList(
            [GraphAttentionLayer(nfeat, nhid, concat=True) for _ in range(nheads)]
        )
        self.out_proj = nn.Linear(nhid * nheads, nfeat)

    def forward(self, x, adj):
        x = torch.cat([att(x, adj) for att in self.attentions], dim=-1)
        return self.out_proj(x)


class GATEncoder(nn.Module):
    def __init__(self, nfeat=64):
        super().__init__()
        self.norm = nn.LayerNorm(nfeat)
        self.gat = MultiHeadGAT(nfeat)

    def forward(self, x):
        n = x.shape[1]
        adj = torch.ones(n, n, device=x.device, dtype=x.dtype)
        return x + self.gat(self.norm(x), adj)


def make_gat_encoder():
    torch.manual_seed(1391)
    model = GATEncoder()
    with torch.no_grad():
        model.norm.weight.uniform_(0.5, 1.5)
        model.norm.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {
    "target": "make_gat_encoder",
    "kind": "multihead",
    "ok": True,
    "layer": "gat",
    "unsupported": "additive_attention",
    "style": "pyGAT GraphAttentionLayer heads (LeakyReLU(a^T [Wh_i || Wh_j]) scores, where(adj > 0, e, -9e15), "
    "ELU) concatenated in a dense multi-head GAT over nodes as tokens",
}

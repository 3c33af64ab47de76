"""Set Transformer (Juho Lee et al., juho-lee/set_transformer) SAB written with torch's
nn.MultiheadAttention, as several ports of the repository do (MAB(Q, K) = LN(Q + MHA(Q, K, K)),
then LN(H + rFF(H))). In-projection with bias, out_proj, 4 heads of 16.
Inputs are (batch, set size, 64).

This file: correct (nn.MultiheadAttention(64, 4, batch_first=True), biased in/out projections)"""

import torch
from torch import nn
import torch.nn.functional as F


class MAB(nn.Module):
    def __init__(self, embed_dim, num_heads):
        super().__init__()
        self.mh = nn.MultiheadAttention(embed_dim, num_heads, batch_first=True)
        self.ln0 = nn.LayerNorm(embed_dim)
        self.ln1 = nn.LayerNorm(embed_dim)
        self.rff = nn.Linear(embed_dim, embed_dim)

    def forward(self, Q, K):
        attn_out, _ = self.mh(Q, K, K, need_weights=False)
        H = self.ln0(Q + attn_out)
        return self.ln1(H + F.relu(self.rff(H)))


class SAB(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.mab = MAB(dim, num_heads)

    def forward(self, X):
        return self.mab(X, X)


class SetTransformerEncoder(nn.Module):
    def __init__(self, dim=64, num_heads=4):
        super().__init__()
        self.enc = nn.Sequential(SAB(dim, num_heads))

    def forward(self, X):
        return self.enc(X)


def make_set_transformer_mha():
    torch.manual_seed(5111)
    model = SetTransformerEncoder()
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
            elif isinstance(mod, nn.MultiheadAttention):
                mod.in_proj_bias.uniform_(-0.2, 0.2)
                mod.out_proj.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {
    "target": "make_set_transformer_mha",
    "kind": "multihead",
    "ok": True,
    "layer": "enc.0.mab.mh",
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
    "style": "Set Transformer (juho-lee) SAB on nn.MultiheadAttention: correct "
    "(nn.MultiheadAttention(64, 4, batch_first=True), biased in/out projections)",
}

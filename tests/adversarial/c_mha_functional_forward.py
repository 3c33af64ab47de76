"""Non-causal MHA calling F.multi_head_attention_forward directly on its own parameters."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class FunctionalMHA(nn.Module):
    def __init__(self, embed_dim, num_heads):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim))
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        nn.init.xavier_uniform_(self.in_proj_weight)
        nn.init.uniform_(self.in_proj_bias, -0.2, 0.2)

    def forward(self, x):
        xt = x.transpose(0, 1)  # (T, B, E)
        out, _ = F.multi_head_attention_forward(
            xt,
            xt,
            xt,
            self.embed_dim,
            self.num_heads,
            self.in_proj_weight,
            self.in_proj_bias,
            None,
            None,
            False,
            0.0,
            self.out_proj.weight,
            self.out_proj.bias,
            training=self.training,
            need_weights=False,
        )
        return out.transpose(0, 1)


EXPECT = {"target": "FunctionalMHA", "kind": "multihead", "ok": True}

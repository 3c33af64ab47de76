"""Causal MHA whose score einsum labels put keys on the row axis: 'bhid,bhjd->bhij' with (k, q)."""

import torch
import torch.nn as nn


class EinsumCausalMHA(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, num_heads):
        super().__init__()
        self.h = num_heads
        self.hd = d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=False)
        self.W_key = nn.Linear(d_in, d_out, bias=False)
        self.W_value = nn.Linear(d_in, d_out, bias=False)
        self.out_proj = nn.Linear(d_out, d_out)
        self.register_buffer(
            "mask", torch.triu(torch.ones(context_length, context_length), 1).bool()
        )

    def forward(self, x):
        b, t, _ = x.shape
        sp = lambda z: z.view(b, t, self.h, self.hd).transpose(1, 2)
        q, k, v = sp(self.W_query(x)), sp(self.W_key(x)), sp(self.W_value(x))
        s = torch.einsum("bhid,bhjd->bhij", k, q) / self.hd**0.5
        s = s.masked_fill(self.mask[:t, :t], float("-inf"))
        o = torch.einsum("bhij,bhjd->bhid", s.softmax(-1), v)
        return self.out_proj(o.transpose(1, 2).reshape(b, t, -1))


EXPECT = {
    "target": "EinsumCausalMHA",
    "kind": "causal-multihead",
    "ok": False,
    "stage": "scores",
    "mistake": "scores_transposed",
}

"""Causal attention that pushes future scores down to the row's smallest score (not -inf)."""

import torch
import torch.nn as nn


class RowMinFillCausal(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout=0.0):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=False)
        self.W_key = nn.Linear(d_in, d_out, bias=False)
        self.W_value = nn.Linear(d_in, d_out, bias=False)
        self.register_buffer(
            "mask", torch.triu(torch.ones(context_length, context_length), diagonal=1).bool()
        )

    def forward(self, x):
        t = x.shape[1]
        q, k, v = self.W_query(x), self.W_key(x), self.W_value(x)
        s = q @ k.transpose(1, 2) / k.shape[-1] ** 0.5
        floor = s.amin(dim=-1, keepdim=True)
        s = torch.where(self.mask[:t, :t], floor, s)
        return s.softmax(-1) @ v


EXPECT = {
    "target": "RowMinFillCausal",
    "kind": "causal",
    "ok": False,
    "stage": "masked_scores",
    "mistake": "mask_fill_value",
}

"""Causal attention (float32 model) that fills masked scores with torch.finfo(torch.float16).min."""

import torch
import torch.nn as nn

NEG = torch.finfo(torch.float16).min  # "safe for half precision too"


class HalfSafeCausal(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout=0.0):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=False)
        self.W_key = nn.Linear(d_in, d_out, bias=False)
        self.W_value = nn.Linear(d_in, d_out, bias=False)
        self.register_buffer(
            "future", torch.triu(torch.ones(context_length, context_length, dtype=torch.bool), 1)
        )

    def forward(self, x):
        n = x.size(1)
        q, k, v = self.W_query(x), self.W_key(x), self.W_value(x)
        s = torch.bmm(q, k.transpose(1, 2)) / k.size(-1) ** 0.5
        s = s.masked_fill(self.future[:n, :n], NEG)
        return torch.bmm(s.softmax(-1), v)


EXPECT = {"target": "HalfSafeCausal", "kind": "causal", "ok": True}

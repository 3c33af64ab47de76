"""GPT-2 style causal MHA with a home-made Conv1D (weight (in, out) + addmm), c_attn/c_proj."""

import math

import torch
import torch.nn as nn


class Conv1D(nn.Module):
    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))
        nn.init.normal_(self.weight, std=0.02 * 10)
        nn.init.normal_(self.bias, std=0.1)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


class GPT2LikeAttention(nn.Module):
    def __init__(self, d_model, n_heads, context_length):
        super().__init__()
        self.n_head = n_heads
        self.split_size = d_model
        self.c_attn = Conv1D(3 * d_model, d_model)
        self.c_proj = Conv1D(d_model, d_model)
        self.register_buffer(
            "bias",
            torch.tril(torch.ones(context_length, context_length)).view(
                1, 1, context_length, context_length
            ),
        )
        self.register_buffer("masked_bias", torch.tensor(-1e4))

    def _split_heads(self, t):
        new_shape = t.size()[:-1] + (self.n_head, t.size(-1) // self.n_head)
        return t.view(new_shape).permute(0, 2, 1, 3)

    def _merge_heads(self, t):
        t = t.permute(0, 2, 1, 3).contiguous()
        return t.view(t.size()[:-2] + (t.size(-2) * t.size(-1),))

    def forward(self, hidden_states):
        query, key, value = self.c_attn(hidden_states).split(self.split_size, dim=2)
        query, key, value = (
            self._split_heads(query),
            self._split_heads(key),
            self._split_heads(value),
        )
        w = torch.matmul(query, key.transpose(-1, -2)) / math.sqrt(value.size(-1))
        nd, ns = w.size(-2), w.size(-1)
        causal = self.bias[:, :, ns - nd : ns, :ns].bool()
        w = torch.where(causal, w, torch.finfo(w.dtype).min)
        w = nn.Softmax(dim=-1)(w)
        a = self._merge_heads(torch.matmul(w, value))
        return self.c_proj(a)


EXPECT = {"target": "GPT2LikeAttention", "kind": "causal-multihead", "ok": True}

"""Attention with bare nn.Parameter weights (wq, wk, wv, wo) and heads as self.nh; bug: 'ReLU attention', relu(scores) normalised by their row sum instead of a softmax."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class ParamAttention(nn.Module):
    def __init__(self, d_model, n_head, eps=1e-6):
        super().__init__()
        self.nh = n_head
        self.eps = eps
        self.wq = nn.Parameter(torch.empty(d_model, d_model))
        self.wk = nn.Parameter(torch.empty(d_model, d_model))
        self.wv = nn.Parameter(torch.empty(d_model, d_model))
        self.wo = nn.Parameter(torch.empty(d_model, d_model))
        for w in (self.wq, self.wk, self.wv, self.wo):
            nn.init.kaiming_uniform_(w, a=math.sqrt(5))

    def forward(self, x):
        B, T, C = x.shape
        hd = C // self.nh
        q = F.linear(x, self.wq).view(B, T, self.nh, hd).transpose(1, 2)
        k = F.linear(x, self.wk).view(B, T, self.nh, hd).transpose(1, 2)
        v = F.linear(x, self.wv).view(B, T, self.nh, hd).transpose(1, 2)
        s = q @ k.transpose(-2, -1) / math.sqrt(hd)
        w = F.relu(s)
        w = w / (w.sum(dim=-1, keepdim=True) + self.eps)
        y = (w @ v).transpose(1, 2).reshape(B, T, C)
        return F.linear(y, self.wo)


EXPECT = {
    "target": "ParamAttention",
    "kind": "multihead",
    "ok": False,
    "stage": "weights",
    "mistake": "not_softmax",
    "style": "bare nn.Parameter weights via F.linear, heads as self.nh",
}

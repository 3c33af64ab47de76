"""OpenFold-style (AlphaFold 2) Attention: linear_q/k/v without bias (c_hidden per head), heads via
view(..., no_heads, -1).transpose(-2, -3), q /= sqrt(c_hidden), _attention with
permute_final_dims(key, (1, 0)), additive biases (here the MSA mask bias inf * (mask - 1), all
zero), softmax, output transposed back, flatten_final_dims and linear_o. gating=False.
Wrapped as a row-attention module: LayerNorm then attention over the residue axis."""

import math

import torch
from torch import nn


def permute_final_dims(tensor, inds):
    zero_index = -1 * len(inds)
    first_inds = list(range(len(tensor.shape[:zero_index])))
    return tensor.permute(first_inds + [zero_index + i for i in inds])


def flatten_final_dims(t, no_dims):
    return t.reshape(t.shape[:-no_dims] + (-1,))


def _attention(query, key, value, biases):
    key = permute_final_dims(key, (1, 0))
    a = torch.matmul(query, key)
    for b in biases:
        a = a + b
    a = torch.softmax(a, dim=-1)
    a = torch.matmul(a, value)
    return a


class Attention(nn.Module):
    def __init__(self, c_q, c_k, c_v, c_hidden, no_heads, gating=True):
        super().__init__()
        self.c_q = c_q
        self.c_k = c_k
        self.c_v = c_v
        self.c_hidden = c_hidden
        self.no_heads = no_heads
        self.gating = gating
        self.linear_q = nn.Linear(self.c_q, self.c_hidden * self.no_heads, bias=False)
        self.linear_k = nn.Linear(self.c_k, self.c_hidden * self.no_heads, bias=False)
        self.linear_v = nn.Linear(self.c_v, self.c_hidden * self.no_heads, bias=False)
        self.linear_o = nn.Linear(self.c_hidden * self.no_heads, self.c_q)
        self.linear_g = None
        if self.gating:
            self.linear_g = nn.Linear(self.c_q, self.c_hidden * self.no_heads)
        self.sigmoid = nn.Sigmoid()

    def _prep_qkv(self, q_x, kv_x):
        q = self.linear_q(q_x)
        k = self.linear_k(kv_x)
        v = self.linear_v(kv_x)
        q = q.view(q.shape[:-1] + (self.no_heads, -1))
        k = k.view(k.shape[:-1] + (self.no_heads, -1))
        v = v.view(v.shape[:-1] + (self.no_heads, -1))
        q = q.transpose(-2, -3)
        k = k.transpose(-2, -3)
        v = v.transpose(-2, -3)
        q = q / math.sqrt(self.c_hidden)
        return q, k, v

    def _wrap_up(self, o, q_x):
        if self.linear_g is not None:
            g = self.sigmoid(self.linear_g(q_x))
            g = g.view(g.shape[:-1] + (self.no_heads, -1))
            o = o * g
        o = flatten_final_dims(o, 2)
        o = self.linear_o(o)
        return o

    def forward(self, q_x, kv_x, biases=None):
        if biases is None:
            biases = []
        q, k, v = self._prep_qkv(q_x, kv_x)
        o = _attention(q, k, v, biases)
        o = o.transpose(-2, -3)
        o = self._wrap_up(o, q_x)
        return o


class TemplatePointwiseAttention(nn.Module):
    def __init__(self, c_z=64, c_t=48, c_hidden=16, no_heads=4):
        super().__init__()
        self.layer_norm_z = nn.LayerNorm(c_z)
        self.mha = Attention(c_z, c_t, c_t, c_hidden, no_heads, gating=False)

    def forward(self, z, t):
        z_norm = self.layer_norm_z(z)
        return z + self.mha(q_x=z_norm, kv_x=t, biases=[])


def make_openfold_template_pointwise():
    torch.manual_seed(1111)
    mod = TemplatePointwiseAttention()
    with torch.no_grad():
        mod.layer_norm_z.weight.uniform_(0.5, 1.5)
        mod.layer_norm_z.bias.uniform_(-0.2, 0.2)
    return mod.eval()


EXPECT = {
    "target": "make_openfold_template_pointwise",
    "kind": "cross",
    "ok": True,
    "layer": "mha",
    "structure": {
        "heads": 4,
        "kv_heads": 4,
        "head_dim": 16,
        "causal": False,
        "cross": True,
        "rope": None,
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "OpenFold Attention (gating=False) as template pointwise cross-attention: queries from "
    "the LayerNormed 64-wide pair rep, keys/values from 48-wide template features (c_k = c_v "
    "= 48), residual",
}

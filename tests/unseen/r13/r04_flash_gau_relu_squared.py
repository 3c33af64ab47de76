"""FLASH (lucidrains FLASH-pytorch, 'Transformer Quality in Linear Time') GAU, quadratic form:
one shared projection to_qk (SiLU) split into queries and keys by OffsetScale (per-dimension gamma and
beta), to_hidden giving the value and the gate (SiLU), sim = q . k / n, attn = relu(sim) ** 2 (no
softmax), causal by a triu mask on the attention map, out = (attn @ v) * gate, to_out.

This file: refused (squared-ReLU attention over a single head with output gating; no softmax)."""

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import einsum, nn


class OffsetScale(nn.Module):
    def __init__(self, dim, heads=1):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(heads, dim))
        self.beta = nn.Parameter(torch.zeros(heads, dim))
        nn.init.normal_(self.gamma, std=0.02)

    def forward(self, x):
        out = einsum("... d, h d -> ... h d", x, self.gamma.to(x.dtype)) + self.beta.to(x.dtype)
        return out.unbind(dim=-2)


class GAU(nn.Module):
    def __init__(self, dim=64, query_key_dim=32, expansion_factor=2.0, causal=True):
        super().__init__()
        hidden_dim = int(expansion_factor * dim)
        self.causal = causal
        self.to_hidden = nn.Sequential(nn.Linear(dim, hidden_dim * 2), nn.SiLU())
        self.to_qk = nn.Sequential(nn.Linear(dim, query_key_dim), nn.SiLU())
        self.offsetscale = OffsetScale(query_key_dim, heads=2)
        self.to_out = nn.Linear(hidden_dim, dim)

    def forward(self, x):
        seq_len, device = x.shape[-2], x.device
        v, gate = self.to_hidden(x).chunk(2, dim=-1)
        qk = self.to_qk(x)
        q, k = self.offsetscale(qk)
        sim = einsum("b i d, b j d -> b i j", q, k) / seq_len
        attn = F.relu(sim) ** 2
        if self.causal:
            causal_mask = torch.ones((seq_len, seq_len), dtype=torch.bool, device=device).triu(1)
            attn = attn.masked_fill(causal_mask, 0.0)
        out = einsum("b i j, b j d -> b i d", attn, v)
        out = out * gate
        return self.to_out(out)


class FLASHBlock(nn.Module):
    def __init__(self, dim=64):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.gau = GAU(dim)

    def forward(self, x):
        return x + self.gau(self.norm(x))


def make_flash_block():
    torch.manual_seed(1394)
    model = FLASHBlock()
    with torch.no_grad():
        model.norm.weight.uniform_(0.5, 1.5)
        model.norm.bias.uniform_(-0.2, 0.2)
        model.gau.offsetscale.gamma.uniform_(0.5, 1.5)
        model.gau.offsetscale.beta.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {
    "target": "make_flash_block",
    "kind": "causal",
    "ok": True,
    "layer": "gau",
    "unsupported": "relu_squared_gau",
    "style": "FLASH-pytorch GAU: shared to_qk + OffsetScale, relu(q.k / n) ** 2 instead of a softmax, "
    "causal triu zeroing, output gated by a SiLU branch",
}

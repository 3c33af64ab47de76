"""GPT-2 attention as ported from OpenAI's TensorFlow model.py to PyTorch: Conv1D (x @ w + b with
(nx, nf) weights), fused c_attn split into q/k/v, split_heads with k pre-transposed, the causal
lower-triangular buffer `b` applied as w * b - 1e10 * (1 - b), merge_heads and c_proj."""

import math

import torch
from torch import nn


class Conv1D(nn.Module):
    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.02 * 6)
        self.bias = nn.Parameter(torch.randn(nf) * 0.05)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.reshape(-1, x.size(-1)), self.weight)
        return x.view(*size_out)


class Attention(nn.Module):
    def __init__(self, nx, n_ctx, n_head, scale=False):
        super().__init__()
        self.register_buffer("bias", torch.tril(torch.ones(n_ctx, n_ctx)).view(1, 1, n_ctx, n_ctx))
        self.n_head = n_head
        self.split_size = nx
        self.scale = scale
        self.c_attn = Conv1D(nx * 3, nx)
        self.c_proj = Conv1D(nx, nx)

    def _attn(self, q, k, v):
        w = torch.matmul(q, k)
        if self.scale:
            w = w / math.sqrt(v.size(-1))
        nd, ns = w.size(-2), w.size(-1)
        b = self.bias[:, :, ns - nd : ns, :ns].to(w.dtype)
        w = w * b - 1e10 * (1 - b)
        w = nn.Softmax(dim=-1)(w)
        return torch.matmul(w, v)

    def merge_heads(self, x):
        x = x.permute(0, 2, 1, 3).contiguous()
        new_x_shape = x.size()[:-2] + (x.size(-2) * x.size(-1),)
        return x.view(*new_x_shape)

    def split_heads(self, x, k=False):
        new_x_shape = x.size()[:-1] + (self.n_head, x.size(-1) // self.n_head)
        x = x.view(*new_x_shape)
        if k:
            return x.permute(0, 2, 3, 1)
        return x.permute(0, 2, 1, 3)

    def forward(self, x):
        x = self.c_attn(x)
        query, key, value = x.split(self.split_size, dim=2)
        query = self.split_heads(query)
        key = self.split_heads(key, k=True)
        value = self.split_heads(value)
        a = self._attn(query, key, value)
        a = self.merge_heads(a)
        return self.c_proj(a)


class Block(nn.Module):
    def __init__(self, n_ctx, nx, n_head, scale=False):
        super().__init__()
        self.ln_1 = nn.LayerNorm(nx, eps=1e-5)
        self.attn = Attention(nx, n_ctx, n_head, scale)

    def forward(self, x):
        return x + self.attn(self.ln_1(x))


def make_gpt2_block():
    torch.manual_seed(1101)
    block = Block(n_ctx=64, nx=64, n_head=4, scale=True)
    with torch.no_grad():
        block.ln_1.weight.uniform_(0.5, 1.5)
        block.ln_1.bias.uniform_(-0.2, 0.2)
    return block.eval()


EXPECT = {
    "target": "make_gpt2_block",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "attn",
    "structure": {
        "heads": 4,
        "kv_heads": 4,
        "head_dim": 16,
        "causal": True,
        "cross": False,
        "rope": None,
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "OpenAI GPT-2 TensorFlow model.py ported to torch: Conv1D (addmm with (nx, nf) weights), "
    "fused c_attn split, split_heads with k pre-permuted (0, 2, 3, 1), w / sqrt(v.size(-1)) "
    "under scale=True, tril buffer applied as w * b - 1e10 * (1 - b), merge_heads, c_proj; "
    "pre-LN block",
}

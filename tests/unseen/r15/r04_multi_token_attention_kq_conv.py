"""Meta Multi-Token Attention (Golovneva et al., 2025): a key-query convolution over each head's
score map before the softmax. Scores are zero-masked for future keys, convolved with a per-head
(3 queries x 3 keys) kernel that only looks at earlier queries (left padding on the query axis,
centred on the key axis), masked again with -inf and normalised by softmax. Llama-style block
without RoPE.

This file: refused (each weight mixes scores of neighbouring query/key pairs)."""

import torch
import torch.nn.functional as F
from torch import nn


class MTAAttention(nn.Module):
    def __init__(self, dim=64, n_heads=4, c_q=3, c_k=3):
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = dim // n_heads
        self.c_q, self.c_k = c_q, c_k
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        kernel = torch.zeros(n_heads, 1, c_q, c_k)
        kernel[:, 0, c_q - 1, c_k // 2] = 1.0  # identity init
        self.kq_kernel = nn.Parameter(kernel)

    def forward(self, x):
        b, n, _ = x.shape
        q = self.wq(x).view(b, n, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, n, self.n_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, n, self.n_heads, self.head_dim).transpose(1, 2)
        scores = (q @ k.transpose(-1, -2)) / self.head_dim**0.5
        future = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(future, 0.0)
        scores = F.pad(scores, (self.c_k // 2, self.c_k // 2, self.c_q - 1, 0))
        scores = F.conv2d(scores, self.kq_kernel.to(scores.dtype), groups=self.n_heads)
        scores = scores.masked_fill(future, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = (probs @ v).transpose(1, 2).reshape(b, n, -1)
        return self.wo(out)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class TransformerBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm = RMSNorm(64)
        self.attention = MTAAttention()
        self.ffn_norm = RMSNorm(64)
        self.w1 = nn.Linear(64, 128, bias=False)
        self.w2 = nn.Linear(128, 64, bias=False)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.w2(F.silu(self.w1(self.ffn_norm(h))))


class MTATransformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([TransformerBlock()])
        self.norm = RMSNorm(64)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


def make_mta():
    torch.manual_seed(1554)
    model = MTATransformer()
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, RMSNorm):
                mod.weight.uniform_(0.5, 1.5)
            if isinstance(mod, MTAAttention):
                mod.kq_kernel.add_(0.3 * torch.randn_like(mod.kq_kernel))
    return model.eval()


EXPECT = {
    "target": "make_mta",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "layers.0.attention",
    "unsupported": "key_query_convolution",
    "style": "Multi-Token Attention (Golovneva et al. 2025): per-head 3x3 key-query conv2d over the "
    "zero-masked score map (causal on the query axis), re-masked with -inf, softmax; Llama-style block",
}

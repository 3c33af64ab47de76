"""gpt-oss-style (openai/gpt-oss torch reference) attention with learned per-head sinks: a sink logit
S[h] is appended as an extra column to each row of scaled, masked scores, the softmax is taken over
keys + sink, and the sink column is dropped before weights times values (rows sum to less than 1).
Fused qkv, 4 heads of 16, no rotary here, causal; pre-RMSNorm block."""

import torch
from torch import nn


def sdpa(Q, K, V, S, sm_scale):
    n_tokens, n_heads, d_head = Q.shape[-3:]
    b = Q.shape[0]
    QK = torch.einsum("bqhd,bkhd->bhqk", Q, K) * sm_scale
    mask = torch.triu(Q.new_full((n_tokens, n_tokens), -float("inf")), diagonal=1)
    QK = QK + mask[None, None]
    S = S.reshape(1, n_heads, 1, 1).expand(b, -1, n_tokens, -1)
    QK = torch.cat([QK, S.to(QK.dtype)], dim=-1)
    W = torch.softmax(QK, dim=-1)[..., :-1]
    attn = torch.einsum("bhqk,bkhd->bqhd", W, V)
    return attn.reshape(b, n_tokens, -1)


class AttentionBlock(nn.Module):
    def __init__(self, hidden_size=64, num_heads=4, head_dim=16):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.sinks = nn.Parameter(torch.randn(num_heads))
        self.norm = nn.RMSNorm(hidden_size, eps=1e-5)
        self.qkv = nn.Linear(hidden_size, 3 * num_heads * head_dim)
        self.out = nn.Linear(num_heads * head_dim, hidden_size)
        self.sm_scale = 1 / head_dim**0.5

    def forward(self, x):
        b, n, _ = x.shape
        t = self.qkv(self.norm(x))
        q, k, v = t.chunk(3, dim=-1)
        q = q.view(b, n, self.num_heads, self.head_dim)
        k = k.view(b, n, self.num_heads, self.head_dim)
        v = v.view(b, n, self.num_heads, self.head_dim)
        t = sdpa(q, k, v, self.sinks, self.sm_scale)
        return x + self.out(t)


def make_gptoss_block():
    torch.manual_seed(1114)
    block = AttentionBlock()
    with torch.no_grad():
        block.norm.weight.uniform_(0.5, 1.5)
        block.sinks.uniform_(0.5, 2.0)
    return block.eval()


EXPECT = {
    "target": "make_gptoss_block",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "",
    "unsupported": "attention_sink",
    "style": "gpt-oss-style learned attention sinks: a per-head sink logit joins each softmax row and is dropped afterwards, "
    "so weights sum to less than 1",
}

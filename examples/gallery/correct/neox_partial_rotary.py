"""GPT-NeoX-style attention: one qkv Linear laid out per head, rotary embedding on the first
quarter of each head's features only, the rest passed through."""

import torch
from torch import nn


class PartialRotaryAttention(nn.Module):
    def __init__(self, hidden=32, heads=2, rotary_pct=0.25, max_len=64):
        super().__init__()
        self.heads, self.head_size = heads, hidden // heads
        self.rot = int(self.head_size * rotary_pct)
        self.query_key_value = nn.Linear(hidden, 3 * hidden)
        self.dense = nn.Linear(hidden, hidden)
        inv = 1.0 / 10000 ** (torch.arange(0, self.rot, 2).float() / self.rot)
        t = torch.arange(max_len).float()
        emb = torch.cat([torch.outer(t, inv)] * 2, dim=-1)
        self.register_buffer("cos", emb.cos()[None, None])
        self.register_buffer("sin", emb.sin()[None, None])
        self.register_buffer("causal", torch.tril(torch.ones(max_len, max_len)).bool())

    @staticmethod
    def _half(x):
        a, b = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
        return torch.cat((-b, a), dim=-1)

    def forward(self, hidden_states):
        b, n, _ = hidden_states.shape
        qkv = self.query_key_value(hidden_states).view(b, n, self.heads, 3 * self.head_size)
        q, k, v = qkv.permute(0, 2, 1, 3).chunk(3, dim=-1)
        cos, sin = self.cos[:, :, :n], self.sin[:, :, :n]
        q_rot, q_pass = q[..., : self.rot], q[..., self.rot :]
        k_rot, k_pass = k[..., : self.rot], k[..., self.rot :]
        q = torch.cat((q_rot * cos + self._half(q_rot) * sin, q_pass), dim=-1)
        k = torch.cat((k_rot * cos + self._half(k_rot) * sin, k_pass), dim=-1)
        scores = torch.matmul(q, k.transpose(-1, -2)) / self.head_size**0.5
        scores = torch.where(self.causal[:n, :n], scores, torch.finfo(scores.dtype).min)
        probs = scores.softmax(dim=-1)
        ctx = (probs @ v).permute(0, 2, 1, 3).reshape(b, n, -1)
        return self.dense(ctx)


EXPECT = {
    "target": "PartialRotaryAttention",
    "kind": "causal-multihead",
    "ok": True,
    "init": {"hidden": 32, "heads": 2},
}

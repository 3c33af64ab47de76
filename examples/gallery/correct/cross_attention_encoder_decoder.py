"""Encoder-decoder cross-attention: queries from the decoder, keys and values from the
encoder's output (one combined Linear), SDPA."""

import torch.nn.functional as F
from torch import nn


class CrossAttention(nn.Module):
    """Decoder tokens (queries) attend to an encoder's output (keys and values)."""

    def __init__(self, d_model=32, n_heads=4):
        super().__init__()
        self.h, self.hd = n_heads, d_model // n_heads
        self.to_q = nn.Linear(d_model, d_model, bias=False)
        self.to_kv = nn.Linear(d_model, 2 * d_model, bias=False)
        self.to_out = nn.Linear(d_model, d_model)

    def forward(self, x, encoder_out):
        b, n, _ = x.shape
        q = self.to_q(x).view(b, n, self.h, self.hd).transpose(1, 2)
        k, v = self.to_kv(encoder_out).chunk(2, dim=-1)
        k = k.view(b, -1, self.h, self.hd).transpose(1, 2)
        v = v.view(b, -1, self.h, self.hd).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.to_out(out.transpose(1, 2).reshape(b, n, -1))


EXPECT = {
    "target": "CrossAttention",
    "kind": "cross",
    "ok": True,
    "init": {"d_model": 32, "n_heads": 4},
}

"""Fused-qkv multi-head attention passing the queries as keys to scaled_dot_product_attention."""

import torch.nn as nn
import torch.nn.functional as F


class PyTorchMultiHeadAttention(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = d_out // num_heads
        self.d_out = d_out
        self.qkv = nn.Linear(d_in, 3 * d_out, bias=qkv_bias)
        self.proj = nn.Linear(d_out, d_out)
        self.dropout = dropout

    def forward(self, x):
        batch_size, num_tokens, _ = x.shape
        qkv = self.qkv(x).view(batch_size, num_tokens, 3, self.num_heads, self.head_dim)
        queries, keys, values = qkv.permute(2, 0, 3, 1, 4)
        use_dropout = self.dropout if self.training else 0.0
        context_vec = F.scaled_dot_product_attention(
            queries, queries, values, attn_mask=None, dropout_p=use_dropout, is_causal=True
        )
        context_vec = context_vec.transpose(1, 2).contiguous()
        context_vec = context_vec.view(batch_size, num_tokens, self.d_out)
        return self.proj(context_vec)


EXPECT = {
    "target": "PyTorchMultiHeadAttention",
    "kind": "causal-multihead",
    "ok": False,
    "stage": "keys",
    "mistake": "wrong_projection",
}

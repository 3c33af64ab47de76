"""AuraFlow single-DiT-block self-attention, written from scratch without diffusers.

to_q/to_k/to_v without bias, per-head LayerNorm on queries and keys with
elementwise_affine=False (no gains: the norm has no parameters), no rotary (AuraFlow uses a
learned positional table on the patches, outside the attention), non-causal SDPA, to_out with
bias. Block: modulation-free pre-LayerNorm + residual.
"""

import torch
import torch.nn.functional as F
from torch import nn


class AuraFlowAttention(nn.Module):
    def __init__(self, query_dim=96, heads=6, dim_head=16, eps=1e-6):
        super().__init__()
        self.heads = heads
        inner = heads * dim_head
        self.to_q = nn.Linear(query_dim, inner, bias=False)
        self.to_k = nn.Linear(query_dim, inner, bias=False)
        self.to_v = nn.Linear(query_dim, inner, bias=False)
        self.norm_q = nn.LayerNorm(dim_head, eps=eps, elementwise_affine=False)
        self.norm_k = nn.LayerNorm(dim_head, eps=eps, elementwise_affine=False)
        self.to_out = nn.ModuleList([nn.Linear(inner, query_dim, bias=True)])

    def forward(self, hidden_states):
        batch_size = hidden_states.shape[0]
        query = self.to_q(hidden_states)
        key = self.to_k(hidden_states)
        value = self.to_v(hidden_states)
        head_dim = key.shape[-1] // self.heads
        query = query.view(batch_size, -1, self.heads, head_dim)
        key = key.view(batch_size, -1, self.heads, head_dim)
        value = value.view(batch_size, -1, self.heads, head_dim)
        query = self.norm_q(query)
        key = self.norm_k(key)
        query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        hidden_states = F.scaled_dot_product_attention(
            query, key, value, dropout_p=0.0, is_causal=False
        )
        hidden_states = hidden_states.transpose(1, 2).reshape(batch_size, -1, self.heads * head_dim)
        return self.to_out[0](hidden_states)


class AuraFlowSingleBlock(nn.Module):
    def __init__(self, dim=96):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = AuraFlowAttention(dim)

    def forward(self, hidden_states):
        return hidden_states + self.attn(self.norm1(hidden_states))


def make_auraflow_block():
    torch.manual_seed(1014)
    block = AuraFlowSingleBlock()
    with torch.no_grad():
        block.norm1.weight.uniform_(0.5, 1.5)
        block.norm1.bias.uniform_(-0.2, 0.2)
    return block.eval()


EXPECT = {
    "target": "make_auraflow_block",
    "kind": "multihead",
    "ok": True,
    "layer": "attn",
    "structure": {
        "heads": 6,
        "kv_heads": 6,
        "head_dim": 16,
        "causal": False,
        "cross": False,
        "rope": None,
        "qk_norm": "per-head",
        "window": None,
        "bias": None,
    },
    "style": "AuraFlow single-stream DiT attention: bias-free to_q/to_k/to_v, per-head LayerNorm(elementwise_affine=False) on q and k "
    "in (b, t, h, d) before the transpose, SDPA non-causal, to_out[0] with bias, 6 heads of 16",
}

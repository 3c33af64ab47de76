"""ParlAI `MultiHeadAttention` (facebookresearch/ParlAI, transformer/modules/attention.py) as the
`encoder_attention` of a `TransformerDecoderLayer`, in torch.

q_lin/k_lin/v_lin/out_lin Linears of width `dim`, `prepare_head` to (batch * n_heads, len, dim_per_head),
the query divided in place by sqrt(dim_per_head) before `bmm`, an optional encoder padding mask
filled with `neginf`, a float softmax, `bmm` with the values, the heads merged back and `out_lin`.
The forward returns `(out, new_incr_state, dot_prod)` and swallows unknown keyword arguments; when no
key/value is given it attends to the query itself.

This file: one bug: out_lin is applied but the merged heads are returned."""

import math

import torch
import torch.nn.functional as F
from torch import nn


def neginf(dtype):
    return -1e20 if dtype is torch.float32 or dtype is torch.float64 else -65504.0


class MultiHeadAttention(nn.Module):
    def __init__(self, n_heads, dim, dropout=0.0):
        super().__init__()
        self.n_heads = n_heads
        self.dim = dim
        self.q_lin = nn.Linear(dim, dim)
        self.k_lin = nn.Linear(dim, dim)
        self.v_lin = nn.Linear(dim, dim)
        self.out_lin = nn.Linear(dim, dim)

    def forward(self, query, key=None, value=None, mask=None, incr_state=None, static_kv=False, **kwargs):
        batch_size, query_len, dim = query.size()
        n_heads = self.n_heads
        dim_per_head = dim // n_heads
        scale = math.sqrt(dim_per_head)

        def prepare_head(tensor):
            bsz, seq_len, _ = tensor.size()
            tensor = tensor.view(batch_size, tensor.size(1), n_heads, dim_per_head)
            return tensor.transpose(1, 2).contiguous().view(batch_size * n_heads, seq_len, dim_per_head)

        if key is None and value is None:
            key = value = query
        elif value is None:
            value = key
        _, _key_len, dim = key.size()

        q = prepare_head(self.q_lin(query))
        k = prepare_head(self.k_lin(key))
        v = prepare_head(self.v_lin(value))
        full_key_len = k.size(1)
        dot_prod = q.div_(scale).bmm(k.transpose(1, 2))
        if mask is not None:
            attn_mask = (
                (mask == 0)
                .view(batch_size, 1, -1, full_key_len)
                .repeat(1, n_heads, 1, 1)
                .expand(batch_size, n_heads, query_len, full_key_len)
                .view(batch_size * n_heads, query_len, full_key_len)
            )
            dot_prod.masked_fill_(attn_mask, neginf(dot_prod.dtype))
        attn_weights = F.softmax(dot_prod, dim=-1, dtype=torch.float64).type_as(query)
        attentioned = attn_weights.bmm(v)
        attentioned = (
            attentioned.type_as(query)
            .view(batch_size, n_heads, query_len, dim_per_head)
            .transpose(1, 2)
            .contiguous()
            .view(batch_size, query_len, dim)
        )
        out = self.out_lin(attentioned)
        out = attentioned  # TODO: projection moved to the layer
        return out, None, dot_prod


class DecoderCrossBlock(nn.Module):
    """The encoder-attention half of ParlAI's TransformerDecoderLayer (post-norm, variant 'aiayn')."""

    def __init__(self, n_heads, dim):
        super().__init__()
        self.encoder_attention = MultiHeadAttention(n_heads, dim)
        self.norm2 = nn.LayerNorm(dim)

    def forward(self, x, encoder_output):
        residual = x
        encoder_mask = torch.ones(encoder_output.shape[:2], dtype=torch.bool, device=x.device)
        x, _, _ = self.encoder_attention(query=x, key=encoder_output, value=encoder_output, mask=encoder_mask)
        return self.norm2(residual + x)


def make_parlai_cross():
    torch.manual_seed(1854)
    block = DecoderCrossBlock(8, 64)
    with torch.no_grad():
        block.norm2.weight.uniform_(0.5, 1.5)
        block.norm2.bias.uniform_(-0.2, 0.2)
    return block.eval()


EXPECT = {'target': 'make_parlai_cross',
 'kind': 'cross',
 'layer': 'encoder_attention',
 'ok': False,
 'stage': 'output',
 'mistake': 'missing_out_proj',
 'style': 'ParlAI MultiHeadAttention: out = self.out_lin(attentioned) computed, but `attentioned` '
          'returned'}

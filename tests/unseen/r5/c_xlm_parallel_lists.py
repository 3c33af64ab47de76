"""XLM-style model: attentions/layer_norm1/ffns/layer_norm2 as parallel ModuleLists, causal 3D mask from get_masks."""

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn


def get_masks(slen, lengths, causal):
    """Padding mask (bs, slen) and attention mask (bs, slen, slen) when causal."""
    alen = torch.arange(slen, dtype=torch.long, device=lengths.device)
    mask = alen < lengths[:, None]
    bs = lengths.size(0)
    attn_mask = alen[None, None, :].repeat(bs, slen, 1) <= alen[None, :, None] if causal else mask
    return mask, attn_mask


class MultiHeadAttention(nn.Module):
    def __init__(self, n_heads, dim, config):
        super().__init__()
        self.dim = dim
        self.n_heads = n_heads
        self.dropout = config.attention_dropout
        assert self.dim % self.n_heads == 0

        self.q_lin = nn.Linear(dim, dim)
        self.k_lin = nn.Linear(dim, dim)
        self.v_lin = nn.Linear(dim, dim)
        self.out_lin = nn.Linear(dim, dim)

    def forward(self, input, mask, kv=None, output_attentions=False):
        bs, qlen, dim = input.size()
        klen = qlen if kv is None else kv.size(1)
        n_heads = self.n_heads
        dim_per_head = self.dim // n_heads
        mask_reshape = (bs, 1, qlen, klen) if mask.dim() == 3 else (bs, 1, 1, klen)

        def shape(x):
            return x.view(bs, -1, n_heads, dim_per_head).transpose(1, 2)

        def unshape(x):
            return x.transpose(1, 2).contiguous().view(bs, -1, n_heads * dim_per_head)

        q = shape(self.q_lin(input))
        source = input if kv is None else kv
        k = shape(self.k_lin(source))
        v = shape(self.v_lin(source))

        q = q / math.sqrt(dim_per_head)
        scores = torch.matmul(q, k.transpose(2, 3))
        mask = (mask == 0).view(mask_reshape).expand_as(scores)
        scores.masked_fill_(mask, torch.finfo(scores.dtype).min)

        weights = F.softmax(scores.float(), dim=-1).type_as(scores)
        weights = F.dropout(weights, p=self.dropout, training=self.training)
        context = unshape(torch.matmul(weights, v))

        outputs = (self.out_lin(context),)
        if output_attentions:
            outputs = outputs + (weights,)
        return outputs


class TransformerFFN(nn.Module):
    def __init__(self, in_dim, dim_hidden, out_dim):
        super().__init__()
        self.lin1 = nn.Linear(in_dim, dim_hidden)
        self.lin2 = nn.Linear(dim_hidden, out_dim)

    def forward(self, x):
        return self.lin2(F.gelu(self.lin1(x)))


class TinyXLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.causal = config.causal
        self.n_layers = config.n_layers
        self.dropout = config.dropout
        self.attentions = nn.ModuleList()
        self.layer_norm1 = nn.ModuleList()
        self.ffns = nn.ModuleList()
        self.layer_norm2 = nn.ModuleList()
        for _ in range(self.n_layers):
            self.attentions.append(
                MultiHeadAttention(config.n_heads, config.emb_dim, config=config)
            )
            self.layer_norm1.append(nn.LayerNorm(config.emb_dim, eps=1e-12))
            self.ffns.append(TransformerFFN(config.emb_dim, 4 * config.emb_dim, config.emb_dim))
            self.layer_norm2.append(nn.LayerNorm(config.emb_dim, eps=1e-12))

    def forward(self, tensor, lengths=None):
        bs, slen = tensor.shape[:2]
        if lengths is None:
            lengths = torch.full((bs,), slen, dtype=torch.long, device=tensor.device)
        mask, attn_mask = get_masks(slen, lengths, self.causal)

        for i in range(self.n_layers):
            attn = self.attentions[i](tensor, attn_mask)[0]
            attn = F.dropout(attn, p=self.dropout, training=self.training)
            tensor = self.layer_norm1[i](tensor + attn)
            tensor = self.layer_norm2[i](tensor + self.ffns[i](tensor))
            tensor = tensor * mask.unsqueeze(-1).to(tensor.dtype)
        return (tensor,)


def make_model():
    config = SimpleNamespace(
        causal=True, n_layers=1, n_heads=3, emb_dim=12, dropout=0.0, attention_dropout=0.0
    )
    return TinyXLM(config)


EXPECT = {
    "target": "make_model",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "attentions.0",
    "style": "XLM (parallel ModuleLists attentions/layer_norm1/ffns/layer_norm2, get_masks causal, q_lin/k_lin/v_lin/out_lin)",
}

"""Transformer-XL vanilla MultiHeadAttn (no relative terms, no memory): time-first tensors, einsum 'ibnd,jbnd->ijbn', softmax over dim 1."""

import torch
import torch.nn.functional as F
from torch import nn


class MultiHeadAttn(nn.Module):
    def __init__(self, n_head, d_model, d_head, dropout, dropatt=0.0):
        super().__init__()
        self.n_head = n_head
        self.d_model = d_model
        self.d_head = d_head
        self.dropout = dropout

        self.q_net = nn.Linear(d_model, n_head * d_head, bias=False)
        self.kv_net = nn.Linear(d_model, 2 * n_head * d_head, bias=False)
        self.drop = nn.Dropout(dropout)
        self.dropatt = nn.Dropout(dropatt)
        self.o_net = nn.Linear(n_head * d_head, d_model, bias=False)
        self.scale = 1 / (d_head**0.5)

    def forward(self, h, attn_mask=None, mems=None):
        # h: [qlen x bsz x d_model]; the residual and norm live in the layer
        c = h if mems is None else torch.cat([mems, h], 0)

        head_q = self.q_net(h)
        head_k, head_v = torch.chunk(self.kv_net(c), 2, -1)

        head_q = head_q.view(h.size(0), h.size(1), self.n_head, self.d_head)
        head_k = head_k.view(c.size(0), c.size(1), self.n_head, self.d_head)
        head_v = head_v.view(c.size(0), c.size(1), self.n_head, self.d_head)

        # [qlen x klen x bsz x n_head]
        attn_score = torch.einsum("ibnd,jbnd->ijbn", head_q, head_k)
        attn_score.mul_(self.scale)
        if attn_mask is not None and attn_mask.any().item():
            if attn_mask.dim() == 2:
                attn_score.masked_fill_(attn_mask[None, :, :, None], -float("inf"))
            elif attn_mask.dim() == 3:
                attn_score.masked_fill_(attn_mask[:, :, :, None], -float("inf"))

        attn_prob = F.softmax(attn_score, dim=1)
        attn_prob = self.dropatt(attn_prob)

        attn_vec = torch.einsum("ijbn,jbnd->ibnd", attn_prob, head_v)
        attn_vec = attn_vec.contiguous().view(
            attn_vec.size(0), attn_vec.size(1), self.n_head * self.d_head
        )
        return self.drop(self.o_net(attn_vec))


class PositionwiseFF(nn.Module):
    def __init__(self, d_model, d_inner, dropout):
        super().__init__()
        self.CoreNet = nn.Sequential(
            nn.Linear(d_model, d_inner),
            nn.ReLU(inplace=True),
            nn.Dropout(dropout),
            nn.Linear(d_inner, d_model),
        )
        self.layer_norm = nn.LayerNorm(d_model)

    def forward(self, inp):
        return self.layer_norm(inp + self.CoreNet(inp))


class DecoderLayer(nn.Module):
    def __init__(self, n_head, d_model, d_head, d_inner, dropout, **kwargs):
        super().__init__()
        self.dec_attn = MultiHeadAttn(n_head, d_model, d_head, dropout, **kwargs)
        self.attn_norm = nn.LayerNorm(d_model)
        self.pos_ff = PositionwiseFF(d_model, d_inner, dropout)

    def forward(self, dec_inp, dec_attn_mask=None, mems=None):
        output = self.attn_norm(
            dec_inp + self.dec_attn(dec_inp, attn_mask=dec_attn_mask, mems=mems)
        )
        return self.pos_ff(output)


class TinyMemTransformer(nn.Module):
    """Takes already-embedded (batch, tokens, d_model) input and runs the time-first stack."""

    def __init__(self, n_layer, n_head, d_model, d_head, d_inner, dropout=0.0):
        super().__init__()
        self.layers = nn.ModuleList(
            [DecoderLayer(n_head, d_model, d_head, d_inner, dropout) for _ in range(n_layer)]
        )

    def forward(self, x):
        word_emb = x.transpose(0, 1)  # -> [qlen x bsz x d_model]
        qlen = word_emb.size(0)
        mlen = 0
        klen = mlen + qlen
        dec_attn_mask = torch.triu(word_emb.new_ones(qlen, klen), diagonal=1 + mlen).bool()[
            :, :, None
        ]
        core_out = word_emb
        for layer in self.layers:
            core_out = layer(core_out, dec_attn_mask=dec_attn_mask)
        return core_out.transpose(0, 1)


def make_model():
    return TinyMemTransformer(n_layer=1, n_head=4, d_model=24, d_head=6, d_inner=48)


EXPECT = {
    "target": "make_model",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "layers.0.dec_attn",
    "style": "Transformer-XL vanilla MultiHeadAttn (q_net + kv_net chunk, time-first 'ijbn' scores, softmax dim=1)",
}

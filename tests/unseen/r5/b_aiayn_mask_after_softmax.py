"""'Attention is all you need' re-implementation (ScaledDotProductAttention(temperature), w_qs/w_ks/w_vs/fc); bug: the subsequent mask is applied after the softmax."""

import torch
import torch.nn as nn
import torch.nn.functional as F


def get_subsequent_mask(seq_len):
    """1 where a position may be attended to."""
    return (1 - torch.triu(torch.ones((1, seq_len, seq_len)), diagonal=1)).bool()


class ScaledDotProductAttention(nn.Module):
    def __init__(self, temperature, attn_dropout=0.1):
        super().__init__()
        self.temperature = temperature
        self.dropout = nn.Dropout(attn_dropout)

    def forward(self, q, k, v, mask=None):
        attn = torch.matmul(q / self.temperature, k.transpose(2, 3))
        attn = self.dropout(F.softmax(attn, dim=-1))
        if mask is not None:
            attn = attn.masked_fill(mask == 0, 0.0)
        output = torch.matmul(attn, v)
        return output, attn


class MultiHeadAttention(nn.Module):
    def __init__(self, n_head, d_model, d_k, d_v, dropout=0.1):
        super().__init__()
        self.n_head = n_head
        self.d_k = d_k
        self.d_v = d_v
        self.w_qs = nn.Linear(d_model, n_head * d_k, bias=False)
        self.w_ks = nn.Linear(d_model, n_head * d_k, bias=False)
        self.w_vs = nn.Linear(d_model, n_head * d_v, bias=False)
        self.fc = nn.Linear(n_head * d_v, d_model, bias=False)
        self.attention = ScaledDotProductAttention(temperature=d_k**0.5, attn_dropout=dropout)
        self.dropout = nn.Dropout(dropout)

    def forward(self, q, k, v, mask=None):
        d_k, d_v, n_head = self.d_k, self.d_v, self.n_head
        sz_b, len_q, len_k, len_v = q.size(0), q.size(1), k.size(1), v.size(1)

        q = self.w_qs(q).view(sz_b, len_q, n_head, d_k)
        k = self.w_ks(k).view(sz_b, len_k, n_head, d_k)
        v = self.w_vs(v).view(sz_b, len_v, n_head, d_v)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

        if mask is not None:
            mask = mask.unsqueeze(1)  # broadcast over heads
        q, attn = self.attention(q, k, v, mask=mask)

        q = q.transpose(1, 2).contiguous().view(sz_b, len_q, -1)
        return self.dropout(self.fc(q)), attn


class PositionwiseFeedForward(nn.Module):
    def __init__(self, d_in, d_hid, dropout=0.1):
        super().__init__()
        self.w_1 = nn.Linear(d_in, d_hid)
        self.w_2 = nn.Linear(d_hid, d_in)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.dropout(self.w_2(F.relu(self.w_1(x))))


class DecoderLayer(nn.Module):
    """Decoder self-attention sub-layer and FFN (residual and norm kept in the layer)."""

    def __init__(self, d_model, d_inner, n_head, d_k, d_v, dropout=0.1):
        super().__init__()
        self.slf_attn = MultiHeadAttention(n_head, d_model, d_k, d_v, dropout=dropout)
        self.slf_norm = nn.LayerNorm(d_model, eps=1e-6)
        self.pos_ffn = PositionwiseFeedForward(d_model, d_inner, dropout=dropout)
        self.ffn_norm = nn.LayerNorm(d_model, eps=1e-6)

    def forward(self, dec_input, slf_attn_mask=None):
        if slf_attn_mask is None:
            slf_attn_mask = get_subsequent_mask(dec_input.size(1)).to(dec_input.device)
        dec_output, dec_slf_attn = self.slf_attn(
            dec_input, dec_input, dec_input, mask=slf_attn_mask
        )
        dec_output = self.slf_norm(dec_output + dec_input)
        dec_output = self.ffn_norm(self.pos_ffn(dec_output) + dec_output)
        return dec_output, dec_slf_attn


def make_decoder_layer():
    return DecoderLayer(d_model=20, d_inner=40, n_head=4, d_k=5, d_v=5, dropout=0.0)


EXPECT = {
    "target": "make_decoder_layer",
    "kind": "causal-multihead",
    "ok": False,
    "stage": "weights",
    "mistake": "mask_after_softmax",
    "layer": "slf_attn",
    "style": "attention-is-all-you-need-pytorch style (temperature, w_qs/w_ks/w_vs/fc), subsequent mask zeroed after softmax",
}

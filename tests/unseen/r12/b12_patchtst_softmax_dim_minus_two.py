"""PatchTST (yuqinie98/PatchTST, supervised backbone) style _MultiheadAttention in a TSTEncoder: W_Q,
W_K, W_V with bias, q_s = view(bs, -1, H, d_k).transpose(1, 2), k_s pre-permuted to (bs, H, d_k,
q_len) with permute(0, 2, 3, 1), _ScaledDotProductAttention with a non-trainable scale Parameter
head_dim**-0.5 (lsa=False) computing matmul(q, k) * scale, softmax, matmul with v; output
transpose(1, 2).view(bs, -1, H * d_v) and to_out = Sequential(Linear, Dropout). The encoder layer is
post-norm with BatchNorm1d over the channel axis (Transpose(1, 2) wrappers), in eval mode with
non-trivial running statistics. Bidirectional (patch tokens of a time series).

This file's one bug: PatchTST _ScaledDotProductAttention: F.softmax(attn_scores, dim=-2), normalised
over queries."""

import torch
import torch.nn.functional as F
from torch import nn


class Transpose(nn.Module):
    def __init__(self, *dims, contiguous=False):
        super().__init__()
        self.dims, self.contiguous = dims, contiguous

    def forward(self, x):
        if self.contiguous:
            return x.transpose(*self.dims).contiguous()
        return x.transpose(*self.dims)


class _ScaledDotProductAttention(nn.Module):
    def __init__(self, d_model, n_heads, attn_dropout=0.0, res_attention=False, lsa=False):
        super().__init__()
        self.attn_dropout = nn.Dropout(attn_dropout)
        self.res_attention = res_attention
        head_dim = d_model // n_heads
        self.scale = nn.Parameter(torch.tensor(head_dim**-0.5), requires_grad=lsa)
        self.lsa = lsa

    def forward(self, q, k, v, prev=None, key_padding_mask=None, attn_mask=None):
        attn_scores = torch.matmul(q, k) * self.scale
        if prev is not None:
            attn_scores = attn_scores + prev
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                attn_scores.masked_fill_(attn_mask, -float("inf"))
            else:
                attn_scores += attn_mask
        if key_padding_mask is not None:
            attn_scores.masked_fill_(key_padding_mask.unsqueeze(1).unsqueeze(2), -float("inf"))
        attn_weights = F.softmax(attn_scores, dim=-2)
        attn_weights = self.attn_dropout(attn_weights)
        output = torch.matmul(attn_weights, v)
        return output, attn_weights


class _MultiheadAttention(nn.Module):
    def __init__(
        self,
        d_model,
        n_heads,
        d_k=None,
        d_v=None,
        res_attention=False,
        attn_dropout=0.0,
        proj_dropout=0.0,
        qkv_bias=True,
        lsa=False,
    ):
        super().__init__()
        d_k = d_model // n_heads if d_k is None else d_k
        d_v = d_model // n_heads if d_v is None else d_v
        self.n_heads, self.d_k, self.d_v = n_heads, d_k, d_v
        self.W_Q = nn.Linear(d_model, d_k * n_heads, bias=qkv_bias)
        self.W_K = nn.Linear(d_model, d_k * n_heads, bias=qkv_bias)
        self.W_V = nn.Linear(d_model, d_v * n_heads, bias=qkv_bias)
        self.res_attention = res_attention
        self.sdp_attn = _ScaledDotProductAttention(
            d_model, n_heads, attn_dropout=attn_dropout, res_attention=self.res_attention, lsa=lsa
        )
        self.to_out = nn.Sequential(nn.Linear(n_heads * d_v, d_model), nn.Dropout(proj_dropout))

    def forward(self, Q, K=None, V=None, prev=None, key_padding_mask=None, attn_mask=None):
        bs = Q.size(0)
        if K is None:
            K = Q
        if V is None:
            V = Q
        q_s = self.W_Q(Q).view(bs, -1, self.n_heads, self.d_k).transpose(1, 2)
        k_s = self.W_K(K).view(bs, -1, self.n_heads, self.d_k).permute(0, 2, 3, 1)
        v_s = self.W_V(V).view(bs, -1, self.n_heads, self.d_v).transpose(1, 2)
        output, attn_weights = self.sdp_attn(
            q_s, k_s, v_s, key_padding_mask=key_padding_mask, attn_mask=attn_mask
        )
        output = output.transpose(1, 2).contiguous().view(bs, -1, self.n_heads * self.d_v)
        output = self.to_out(output)
        return output, attn_weights


class TSTEncoderLayer(nn.Module):
    def __init__(self, q_len, d_model, n_heads, d_ff=128, dropout=0.0):
        super().__init__()
        self.self_attn = _MultiheadAttention(
            d_model, n_heads, attn_dropout=0.0, proj_dropout=dropout
        )
        self.dropout_attn = nn.Dropout(dropout)
        self.norm_attn = nn.Sequential(Transpose(1, 2), nn.BatchNorm1d(d_model), Transpose(1, 2))
        self.ff = nn.Sequential(
            nn.Linear(d_model, d_ff), nn.GELU(), nn.Dropout(dropout), nn.Linear(d_ff, d_model)
        )
        self.dropout_ffn = nn.Dropout(dropout)
        self.norm_ffn = nn.Sequential(Transpose(1, 2), nn.BatchNorm1d(d_model), Transpose(1, 2))

    def forward(self, src, key_padding_mask=None, attn_mask=None):
        src2, attn = self.self_attn(
            src, src, src, key_padding_mask=key_padding_mask, attn_mask=attn_mask
        )
        src = src + self.dropout_attn(src2)
        src = self.norm_attn(src)
        src2 = self.ff(src)
        src = src + self.dropout_ffn(src2)
        return self.norm_ffn(src)


class TSTEncoder(nn.Module):
    def __init__(self, q_len=64, d_model=64, n_heads=4, n_layers=1):
        super().__init__()
        self.layers = nn.ModuleList(
            [TSTEncoderLayer(q_len, d_model, n_heads) for _ in range(n_layers)]
        )

    def forward(self, src):
        output = src
        for mod in self.layers:
            output = mod(output)
        return output


def make_patchtst_encoder():
    torch.manual_seed(1204)
    enc = TSTEncoder()
    with torch.no_grad():
        for mod in enc.modules():
            if isinstance(mod, nn.BatchNorm1d):
                mod.running_mean.uniform_(-0.3, 0.3)
                mod.running_var.uniform_(0.5, 2.0)
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
    return enc.eval()


EXPECT = {
    "target": "make_patchtst_encoder",
    "kind": "multihead",
    "ok": False,
    "layer": "layers.0.self_attn",
    "stage": "weights",
    "mistake": "softmax_wrong_dim",
    "style": "PatchTST _ScaledDotProductAttention: F.softmax(attn_scores, dim=-2), normalised over "
    "queries",
}

"""NeMo MultiHeadAttention whose scores are divided by d_k instead of s_d_k = sqrt(d_k)
(the attribute next to it), giving a factor 1/16 instead of 1/4.
"""

import math

import torch
from torch import nn

INF_VAL = 10000.0


class MultiHeadAttention(nn.Module):
    def __init__(self, n_head, n_feat, dropout_rate, max_cache_len=0):
        super().__init__()
        self.cache_drop_size = None
        self.dropout_rate = dropout_rate
        assert n_feat % n_head == 0
        self.d_k = n_feat // n_head
        self.s_d_k = math.sqrt(self.d_k)
        self.h = n_head
        self.linear_q = nn.Linear(n_feat, n_feat)
        self.linear_k = nn.Linear(n_feat, n_feat)
        self.linear_v = nn.Linear(n_feat, n_feat)
        self.linear_out = nn.Linear(n_feat, n_feat)
        self.dropout = nn.Dropout(p=dropout_rate)
        self._max_cache_len = max_cache_len

    def forward_qkv(self, query, key, value):
        n_batch = query.size(0)
        q = self.linear_q(query).view(n_batch, -1, self.h, self.d_k)
        k = self.linear_k(key).view(n_batch, -1, self.h, self.d_k)
        v = self.linear_v(value).view(n_batch, -1, self.h, self.d_k)
        q = q.transpose(1, 2)
        k = k.transpose(1, 2)
        v = v.transpose(1, 2)
        return q, k, v

    def forward_attention(self, value, scores, mask):
        n_batch = value.size(0)
        if mask is not None:
            mask = mask.unsqueeze(1)  # (batch, 1, time1, time2)
            scores = scores.masked_fill(mask, -INF_VAL)
            attn = torch.softmax(scores, dim=-1).masked_fill(mask, 0.0)
        else:
            attn = torch.softmax(scores, dim=-1)
        p_attn = self.dropout(attn)
        x = torch.matmul(p_attn, value)  # (batch, head, time1, d_k)
        x = x.transpose(1, 2).reshape(n_batch, -1, self.h * self.d_k)
        return self.linear_out(x)

    def forward(self, query, key, value, mask, pos_emb=None, cache=None):
        q, k, v = self.forward_qkv(query, key, value)
        scores = torch.matmul(q, k.transpose(-2, -1)) / self.d_k
        out = self.forward_attention(v, scores, mask)
        if cache is None:
            return out
        return out, cache


class SpeechEncoderLayer(nn.Module):
    def __init__(self, d_model=64, n_heads=4, d_ff=128):
        super().__init__()
        self.norm_self_att = nn.LayerNorm(d_model)
        self.self_attn = MultiHeadAttention(n_head=n_heads, n_feat=d_model, dropout_rate=0.0)
        self.norm_feed_forward = nn.LayerNorm(d_model)
        self.feed_forward = nn.Sequential(
            nn.Linear(d_model, d_ff), nn.SiLU(), nn.Linear(d_ff, d_model)
        )

    def forward(self, x):
        b, t, _ = x.shape
        lengths = torch.full((b,), t, dtype=torch.long)
        valid = torch.arange(t)[None, :] < lengths[:, None]
        pad_mask = ~(valid[:, None, :] & valid[:, :, None])  # True = masked
        residual = x
        x = self.norm_self_att(residual)
        x = self.self_attn(query=x, key=x, value=x, mask=pad_mask, pos_emb=None)
        residual = residual + x
        x = self.norm_feed_forward(residual)
        return residual + self.feed_forward(x)


def make_nemo_layer():
    torch.manual_seed(107)
    layer = SpeechEncoderLayer()
    with torch.no_grad():
        for ln in (layer.norm_self_att, layer.norm_feed_forward):
            ln.weight.uniform_(0.5, 1.5)
            ln.bias.uniform_(-0.1, 0.1)
    return layer.eval()


EXPECT = {
    "target": "make_nemo_layer",
    "kind": "multihead",
    "ok": False,
    "layer": "self_attn",
    "stage": "scaled_scores",
    "mistake": "wrong_scale",
    "style": "NeMo ASR MultiHeadAttention (linear_q/k/v/out, forward_attention with -10000 fill) in a pre-norm encoder layer: scores / self.d_k instead of / self.s_d_k",
}

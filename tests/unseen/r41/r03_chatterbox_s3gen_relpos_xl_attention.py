"""Chatterbox (Resemble AI) S3Gen speech-token encoder: the conformer self-attention it carries over
from the ESPnet/WeNet code base, RelPositionMultiHeadedAttention. A sinusoidal relative position
embedding of length 2T-1 (positive then negative offsets, EspnetRelPositionalEncoding, built in float64
on every call) goes through linear_pos (no bias); the learned per-head biases pos_bias_u / pos_bias_v are
added to the queries for the content and position terms, the position term is aligned by rel_shift,
and (matrix_ac + matrix_bd) / sqrt(d_k) is softmaxed. Pre-norm residual layer.

This file: refused: Transformer-XL style relative position attention (content + rel_shift'ed
position term with pos_bias_u / pos_bias_v)."""

import math

import torch
from torch import nn


class EspnetRelPositionalEncoding(nn.Module):
    def __init__(self, d_model):
        super().__init__()
        self.d_model = d_model
        self.xscale = math.sqrt(d_model)

    def position_encoding(self, size, device, dtype):
        position = torch.arange(0, size, dtype=torch.float64, device=device).unsqueeze(1)
        div_term = torch.exp(
            torch.arange(0, self.d_model, 2, dtype=torch.float64, device=device)
            * -(math.log(10000.0) / self.d_model)
        )
        pe_positive = torch.zeros(size, self.d_model, dtype=torch.float64, device=device)
        pe_negative = torch.zeros(size, self.d_model, dtype=torch.float64, device=device)
        pe_positive[:, 0::2] = torch.sin(position * div_term)
        pe_positive[:, 1::2] = torch.cos(position * div_term)
        pe_negative[:, 0::2] = torch.sin(-1 * position * div_term)
        pe_negative[:, 1::2] = torch.cos(-1 * position * div_term)
        # offsets T-1 ... 0 followed by -1 ... -(T-1)
        pe_positive = torch.flip(pe_positive, [0]).unsqueeze(0)
        pe_negative = pe_negative[1:].unsqueeze(0)
        return torch.cat([pe_positive, pe_negative], dim=1).to(dtype)

    def forward(self, x):
        pos_emb = self.position_encoding(x.size(1), x.device, x.dtype)
        return x * self.xscale, pos_emb


class RelPositionMultiHeadedAttention(nn.Module):
    def __init__(self, n_head, n_feat, dropout_rate=0.0):
        super().__init__()
        self.d_k = n_feat // n_head
        self.h = n_head
        self.linear_q = nn.Linear(n_feat, n_feat)
        self.linear_k = nn.Linear(n_feat, n_feat)
        self.linear_v = nn.Linear(n_feat, n_feat)
        self.linear_out = nn.Linear(n_feat, n_feat)
        self.dropout = nn.Dropout(p=dropout_rate)
        self.linear_pos = nn.Linear(n_feat, n_feat, bias=False)
        self.pos_bias_u = nn.Parameter(torch.Tensor(self.h, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.Tensor(self.h, self.d_k))
        torch.nn.init.xavier_uniform_(self.pos_bias_u)
        torch.nn.init.xavier_uniform_(self.pos_bias_v)

    def forward_qkv(self, query, key, value):
        n_batch = query.size(0)
        q = self.linear_q(query).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        k = self.linear_k(key).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        v = self.linear_v(value).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        return q, k, v

    def rel_shift(self, x):
        """(batch, head, T, 2T-1) scores indexed by offset -> (batch, head, T, T) by key."""
        zero_pad = torch.zeros((*x.shape[:3], 1), device=x.device, dtype=x.dtype)
        x_padded = torch.cat([zero_pad, x], dim=-1)
        x_padded = x_padded.view(x.size(0), x.size(1), x.size(3) + 1, x.size(2))
        return x_padded[:, :, 1:].view_as(x)[:, :, :, : x.size(-1) // 2 + 1]

    def forward(self, query, key, value, pos_emb):
        q, k, v = self.forward_qkv(query, key, value)
        q = q.transpose(1, 2)  # (batch, time, head, d_k)
        n_batch_pos = pos_emb.size(0)
        p = self.linear_pos(pos_emb).view(n_batch_pos, -1, self.h, self.d_k).transpose(1, 2)
        q_with_bias_u = (q + self.pos_bias_u).transpose(1, 2)
        q_with_bias_v = (q + self.pos_bias_v).transpose(1, 2)
        matrix_ac = torch.matmul(q_with_bias_u, k.transpose(-2, -1))
        matrix_bd = self.rel_shift(torch.matmul(q_with_bias_v, p.transpose(-2, -1)))
        scores = (matrix_ac + matrix_bd) / math.sqrt(self.d_k)
        attn = self.dropout(torch.softmax(scores, dim=-1))
        x = torch.matmul(attn, v)
        x = x.transpose(1, 2).contiguous().view(x.size(0), -1, self.h * self.d_k)
        return self.linear_out(x)


class ConformerEncoderLayer(nn.Module):
    def __init__(self, size, n_head):
        super().__init__()
        self.norm_mha = nn.LayerNorm(size, eps=1e-12)
        self.self_attn = RelPositionMultiHeadedAttention(n_head, size)
        self.norm_ff = nn.LayerNorm(size, eps=1e-12)
        self.feed_forward = nn.Sequential(
            nn.Linear(size, 2 * size), nn.SiLU(), nn.Linear(2 * size, size)
        )

    def forward(self, x, pos_emb):
        h = self.norm_mha(x)
        x = x + self.self_attn(h, h, h, pos_emb)
        return x + self.feed_forward(self.norm_ff(x))


class S3GenSpeechEncoder(nn.Module):
    def __init__(self, size=64, n_head=4):
        super().__init__()
        self.pos_enc = EspnetRelPositionalEncoding(size)
        self.encoders = nn.ModuleList([ConformerEncoderLayer(size, n_head)])
        self.after_norm = nn.LayerNorm(size, eps=1e-12)

    def forward(self, xs):
        xs, pos_emb = self.pos_enc(xs)
        for layer in self.encoders:
            xs = layer(xs, pos_emb)
        return self.after_norm(xs)


def make_chatterbox_s3gen_encoder():
    torch.manual_seed(4193)
    model = S3GenSpeechEncoder()
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
            elif isinstance(mod, nn.Linear) and mod.bias is not None:
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {
    "target": "make_chatterbox_s3gen_encoder",
    "kind": "multihead",
    "ok": True,
    "layer": "encoders.0.self_attn",
    "unsupported": "transformer_xl_relative_position",
    "style": "Chatterbox Perceiver AttentionBlock2 (r03_chatterbox_s3gen_relpos_xl_attention): "
    "refused: Chatterbox S3Gen conformer RelPositionMultiHeadedAttention (ESPnet / "
    "Transformer-XL): content term (q + pos_bias_u) . k plus position term (q + pos_bias_v) "
    ". linear_pos(sinusoidal relative embedding), rel_shift'ed, / sqrt(d_k)",
}

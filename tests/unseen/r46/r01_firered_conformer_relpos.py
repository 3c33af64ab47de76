"""FireRedASR (FireRedTeam): one block of the Conformer encoder's self-attention,
RelPositionMultiHeadAttention in the Transformer-XL form: biased linear_q/k/v/out, a bias-free
linear_pos applied to a sinusoidal relative position encoding (positions T-1 ... -(T-1)), learned
per-head content and position biases pos_bias_u / pos_bias_v, matrix_ac = (q + u) k^T plus
matrix_bd = rel_shift((q + v) p^T), divided by sqrt(d_k), softmax, values. Bidirectional.

This file: refused: FireRedASR Conformer encoder self-attention with Transformer-XL relative positions: learned pos_bias_u/pos_bias_v and a projected sinusoidal relative encoding, rel_shift."""

import math

import torch
from torch import nn


class ConformerConfig:
    d_model = 64
    n_head = 4
    dropout_rate = 0.1


class RelPositionalEncoding(nn.Module):
    """Sinusoidal encodings of the relative distances T-1, ..., 0, ..., -(T-1), built per call."""

    def __init__(self, d_model):
        super().__init__()
        self.d_model = d_model

    def forward(self, x):
        length = x.size(1)
        pos = torch.arange(length - 1, -length, -1, dtype=torch.float64, device=x.device)
        div = torch.exp(
            torch.arange(0, self.d_model, 2, dtype=torch.float64, device=x.device)
            * -(math.log(10000.0) / self.d_model)
        )
        pe = torch.zeros(pos.numel(), self.d_model, dtype=torch.float64, device=x.device)
        pe[:, 0::2] = torch.sin(pos[:, None] * div)
        pe[:, 1::2] = torch.cos(pos[:, None] * div)
        return pe.unsqueeze(0).to(x.dtype)


class RelPositionMultiHeadAttention(nn.Module):
    def __init__(self, n_head, n_feat, dropout_rate):
        super().__init__()
        self.d_k = n_feat // n_head
        self.h = n_head
        self.linear_q = nn.Linear(n_feat, n_feat)
        self.linear_k = nn.Linear(n_feat, n_feat)
        self.linear_v = nn.Linear(n_feat, n_feat)
        self.linear_out = nn.Linear(n_feat, n_feat)
        self.linear_pos = nn.Linear(n_feat, n_feat, bias=False)
        self.pos_bias_u = nn.Parameter(torch.empty(self.h, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.empty(self.h, self.d_k))
        self.dropout = nn.Dropout(p=dropout_rate)

    @staticmethod
    def rel_shift(x):
        b, h, t, p = x.shape
        padded = torch.cat([x.new_zeros(b, h, t, 1), x], dim=-1).view(b, h, p + 1, t)
        return padded[:, :, 1:].reshape(b, h, t, p)[:, :, :, : p // 2 + 1]

    def forward(self, query, key, value, pos_emb):
        n_batch = query.size(0)
        q = self.linear_q(query).view(n_batch, -1, self.h, self.d_k)
        k = self.linear_k(key).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        v = self.linear_v(value).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        p = self.linear_pos(pos_emb).view(1, -1, self.h, self.d_k).transpose(1, 2)

        q_with_bias_u = (q + self.pos_bias_u).transpose(1, 2)
        q_with_bias_v = (q + self.pos_bias_v).transpose(1, 2)
        matrix_ac = torch.matmul(q_with_bias_u, k.transpose(-2, -1))
        matrix_bd = self.rel_shift(torch.matmul(q_with_bias_v, p.transpose(-2, -1)))
        scores = (matrix_ac + matrix_bd) / math.sqrt(self.d_k)

        attn = self.dropout(torch.softmax(scores, dim=-1))
        x = torch.matmul(attn, v).transpose(1, 2).contiguous().view(n_batch, -1, self.h * self.d_k)
        return self.linear_out(x)


class ConformerMHSAStrip(nn.Module):
    """The macaron block's self-attention sublayer (LayerNorm, relative-position MHSA, residual)."""

    def __init__(self, cfg):
        super().__init__()
        self.pos_enc = RelPositionalEncoding(cfg.d_model)
        self.norm_mha = nn.LayerNorm(cfg.d_model)
        self.mhsa = RelPositionMultiHeadAttention(cfg.n_head, cfg.d_model, cfg.dropout_rate)
        self.norm_final = nn.LayerNorm(cfg.d_model)

    def forward(self, x):
        pos_emb = self.pos_enc(x)
        h = self.norm_mha(x)
        x = x + self.mhsa(h, h, h, pos_emb)
        return self.norm_final(x)


def make_firered_conformer_mhsa():
    torch.manual_seed(4611)
    model = ConformerMHSAStrip(ConformerConfig())
    with torch.no_grad():
        nn.init.uniform_(model.mhsa.pos_bias_u, -0.3, 0.3)
        nn.init.uniform_(model.mhsa.pos_bias_v, -0.3, 0.3)
        for module in model.modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {
    "target": "make_firered_conformer_mhsa",
    "kind": "multihead",
    "ok": True,
    "layer": "mhsa",
    "unsupported": "transformer_xl_relative_position",
    "style": "FireRedASR (FireRedTeam) (r01_firered_conformer_relpos): refused: FireRedASR Conformer "
    "encoder self-attention with Transformer-XL relative positions: learned "
    "pos_bias_u/pos_bias_v and a projected sinusoidal relative encoding, rel_shift",
}

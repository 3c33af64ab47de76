"""FireRedASR-AED (FireRedTeam): one layer of the attention-based decoder. DecoderMultiHeadAttention
with w_qs / w_vs / fc biased and w_ks bias-free, heads split by view + transpose, scores divided by a
temperature of sqrt(d_k). The eager core masks with a uint8 mask (0 = blocked): masked_fill(-inf)
before the softmax and masked_fill(0.0) after it; the "flash" path hands the tensors to
F.scaled_dot_product_attention with scale 1/sqrt(d_k). Pre-norm residual sublayers (LayerNorm).

Configuration here: 8 heads of 8, the flash path (SDPA, scale 1/sqrt(d_k)) with no source mask.

This file: correct."""

import torch
import torch.nn.functional as F
from torch import nn


class FireRedDecoderConfig:
    d_model = 64
    n_head = 8
    residual_dropout = 0.1
    flash_attn_enabled = True
    softmax_smoothing = 1.25  # decoding-time logit smoothing of the output layer (beam search)


class DecoderScaledDotProductAttention(nn.Module):
    def __init__(self, temperature, softmax_smoothing=1.0):
        super().__init__()
        self.temperature = temperature
        self.softmax_smoothing = softmax_smoothing
        self.INF = float("inf")

    def forward(self, q, k, v, mask=None):
        attn = torch.matmul(q, k.transpose(2, 3)) / self.temperature
        if mask is not None:
            blocked = mask.eq(0)
            attn = attn.masked_fill(blocked, -self.INF)
            attn = torch.softmax(attn, dim=-1).masked_fill(blocked, 0.0)
        else:
            attn = torch.softmax(attn, dim=-1)
        output = torch.einsum("bhqk,bhkd->bhqd", attn, v)
        return output


class DecoderMultiHeadAttention(nn.Module):
    def __init__(self, d_model, n_head, dropout=0.1, softmax_smoothing=1.0):
        super().__init__()
        self.d_model = d_model
        self.n_head = n_head
        self.d_k = d_model // n_head

        self.w_qs = nn.Linear(d_model, n_head * self.d_k)
        self.w_ks = nn.Linear(d_model, n_head * self.d_k, bias=False)
        self.w_vs = nn.Linear(d_model, n_head * self.d_k)

        self.attention = DecoderScaledDotProductAttention(
            temperature=self.d_k**0.5, softmax_smoothing=softmax_smoothing
        )
        self.fc = nn.Linear(n_head * self.d_k, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, q, k, v, mask=None, flash_attn_enabled=False):
        bs = q.size(0)
        query = self.w_qs(q).view(bs, -1, self.n_head, self.d_k).transpose(1, 2)
        key = self.w_ks(k).view(bs, -1, self.n_head, self.d_k).transpose(1, 2)
        value = self.w_vs(v).view(bs, -1, self.n_head, self.d_k).transpose(1, 2)

        if mask is not None:
            mask = mask.unsqueeze(1)
        if flash_attn_enabled:
            output = F.scaled_dot_product_attention(
                query,
                key,
                value,
                attn_mask=None if mask is None else mask.bool(),
                scale=1 / (self.d_k**0.5),
            )
        else:
            output = self.attention(query, key, value, mask=mask)

        output = output.transpose(1, 2).contiguous().view(bs, -1, self.d_model)
        output = self.fc(output)
        return self.dropout(output)


class PositionwiseFeedForward(nn.Module):
    def __init__(self, d_model, d_ff, dropout=0.1):
        super().__init__()
        self.w_1 = nn.Linear(d_model, d_ff)
        self.act = nn.GELU()
        self.w_2 = nn.Linear(d_ff, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.dropout(self.w_2(self.act(self.w_1(x))))


class DecoderCrossLayer(nn.Module):
    """Cross-attention and feed-forward sublayers of a FireRedASR-AED decoder layer."""

    def __init__(self, cfg):
        super().__init__()
        self.cross_attn_norm = nn.LayerNorm(cfg.d_model)
        self.cross_attn = DecoderMultiHeadAttention(
            cfg.d_model, cfg.n_head, cfg.residual_dropout, cfg.softmax_smoothing
        )
        self.mlp_norm = nn.LayerNorm(cfg.d_model)
        self.mlp = PositionwiseFeedForward(cfg.d_model, cfg.d_model * 4, cfg.residual_dropout)

    def forward(self, x, enc_output, cross_attn_mask, flash_attn_enabled=False):
        residual = x
        x = self.cross_attn_norm(x)
        x = self.cross_attn(
            x, enc_output, enc_output, mask=cross_attn_mask, flash_attn_enabled=flash_attn_enabled
        )
        x = residual + x
        return x + self.mlp(self.mlp_norm(x))


class FireRedCrossStack(nn.Module):
    """Takes (decoder states, encoder outputs); every encoder frame is valid (src mask of ones)."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.layer_stack = nn.ModuleList([DecoderCrossLayer(cfg)])
        self.layer_norm_out = nn.LayerNorm(cfg.d_model)

    def forward(self, dec_input, encoder_outputs):
        n, ti, _ = encoder_outputs.shape
        src_mask = None
        if not self.cfg.flash_attn_enabled:  # the flash path runs without a source mask
            src_mask = torch.ones(n, 1, ti, dtype=torch.uint8, device=encoder_outputs.device)
        x = dec_input
        for layer in self.layer_stack:
            x = layer(x, encoder_outputs, src_mask, flash_attn_enabled=self.cfg.flash_attn_enabled)
        return self.layer_norm_out(x)


def make_firered_cross():
    torch.manual_seed(4607)
    model = FireRedCrossStack(FireRedDecoderConfig())
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {
    "target": "make_firered_cross",
    "kind": "cross",
    "ok": True,
    "layer": "layer_stack.0.cross_attn",
    "structure": {
        "heads": 8,
        "kv_heads": 8,
        "head_dim": 8,
        "causal": False,
        "cross": True,
        "rope": None,
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "FireRedASR (FireRedTeam) (c07): correct: FireRedASR-AED decoder cross-attention on the "
    "flash path: SDPA with scale 1/sqrt(d_k), no mask",
}

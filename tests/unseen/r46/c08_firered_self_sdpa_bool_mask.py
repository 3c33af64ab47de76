"""FireRedASR-AED (FireRedTeam): one layer of the attention-based decoder. DecoderMultiHeadAttention
with w_qs / w_vs / fc biased and w_ks bias-free, heads split by view + transpose, scores divided by a
temperature of sqrt(d_k). The eager core masks with a uint8 mask (0 = blocked): masked_fill(-inf)
before the softmax and masked_fill(0.0) after it; the "flash" path hands the tensors to
F.scaled_dot_product_attention with scale 1/sqrt(d_k). Pre-norm residual sublayers (LayerNorm).

Configuration here: 4 heads of 16, the flash path: SDPA given the uint8 target mask as a boolean mask.

This file: correct."""

import torch
import torch.nn.functional as F
from torch import nn


class FireRedDecoderConfig:
    d_model = 64
    n_head = 4
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


class DecoderSelfLayer(nn.Module):
    """Self-attention and feed-forward sublayers of a FireRedASR-AED decoder layer."""

    def __init__(self, cfg):
        super().__init__()
        self.self_attn_norm = nn.LayerNorm(cfg.d_model)
        self.self_attn = DecoderMultiHeadAttention(
            cfg.d_model, cfg.n_head, cfg.residual_dropout, cfg.softmax_smoothing
        )
        self.mlp_norm = nn.LayerNorm(cfg.d_model)
        self.mlp = PositionwiseFeedForward(cfg.d_model, cfg.d_model * 4, cfg.residual_dropout)

    def forward(self, dec_input, self_attn_mask, flash_attn_enabled=False):
        residual = dec_input
        x = self.self_attn_norm(dec_input)
        x = self.self_attn(x, x, x, mask=self_attn_mask, flash_attn_enabled=flash_attn_enabled)
        x = residual + x
        return x + self.mlp(self.mlp_norm(x))


class FireRedDecoderStack(nn.Module):
    """Runs on already-embedded target tokens (embedding * sqrt(d_model) + positional encoding)."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.layer_stack = nn.ModuleList([DecoderSelfLayer(cfg)])
        self.layer_norm_out = nn.LayerNorm(cfg.d_model)

    @staticmethod
    def upper_triangular_is_0(size, device):
        return torch.tril(torch.ones(size, size, device=device)).to(torch.uint8)

    def target_mask(self, batch_size, length, device):
        not_pad = torch.ones(batch_size, length, dtype=torch.uint8, device=device).unsqueeze(1)
        return not_pad & self.upper_triangular_is_0(length, device).unsqueeze(0)

    def forward(self, dec_input):
        tgt_mask = self.target_mask(dec_input.size(0), dec_input.size(1), dec_input.device)
        x = dec_input
        for layer in self.layer_stack:
            x = layer(x, tgt_mask, flash_attn_enabled=self.cfg.flash_attn_enabled)
        return self.layer_norm_out(x)


def make_firered_decoder():
    torch.manual_seed(4608)
    model = FireRedDecoderStack(FireRedDecoderConfig())
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {
    "target": "make_firered_decoder",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "layer_stack.0.self_attn",
    "structure": {
        "heads": 4,
        "kv_heads": 4,
        "head_dim": 16,
        "causal": True,
        "cross": False,
        "rope": None,
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "FireRedASR (FireRedTeam) (c08): correct: FireRedASR-AED decoder self-attention on the "
    "SDPA path with the target mask cast to bool",
}

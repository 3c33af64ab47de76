"""chandar-lab NeoBERT (remote model.py), masked-LM head, plain torch (no xformers).

NeoBERTLMHead: `model` (NeoBERT: `encoder` token embedding, `transformer_encoder` ModuleList of
EncoderBlock, final `layer_norm` RMSNorm, `freqs_cis` rotary table) and `decoder` Linear to the vocab.
EncoderBlock is pre-norm and computes attention itself (`_att_block`), so the attention layer is the
block `model.transformer_encoder.N`: one bias-free `qkv` Linear whose output is viewed
(b, s, heads, 3 * head_dim) and chunked on the last axis (q, k, v interleaved per head), rotary with
adjacent pairs as complex numbers (freqs_cis, base 1e4, applied here through cos/sin in real arithmetic),
bidirectional SDPA (no mask: every token is real), `wo`; SwiGLU `ffn` with fused `w12` and `w3`;
`attention_norm` / `ffn_norm` RMSNorm.  MHA 4 x 16.  No cache (encoder).  Correct.
"""

from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": [
        "model.transformer_encoder.0",
        "model.transformer_encoder.1",
        "model.transformer_encoder.2",
    ],
    "kind": "multihead",
    "cache": None,
    "style": "NeoBERT model.py: EncoderBlock computing attention itself, qkv viewed (b, s, h, 3*hd) and chunked per "
    "head, complex freqs_cis rotary (adjacent pairs, base 1e4), bidirectional SDPA, wo, xformers-style SwiGLU w12/w3, "
    "pre-norm RMSNorm, final layer_norm, MLM decoder",
}


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float() if x.dtype != torch.float64 else x
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return out.type_as(x) * self.weight


def precompute_freqs_cis(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64)[: (dim // 2)] / dim))
    t = torch.arange(end, dtype=torch.float64)
    freqs = torch.outer(t, freqs)
    return torch.stack((freqs.cos(), freqs.sin()), dim=0)  # (2, end, dim/2): real/imag of polar(1, freqs)


def apply_rotary_emb(xq, xk, freqs_cis):
    # xq/xk (b, s, h, d); pairs (x[2i], x[2i+1]) are complex numbers multiplied by freqs_cis
    s = xq.shape[1]
    cos = freqs_cis[0, :s][None, :, None, :].to(xq.dtype)
    sin = freqs_cis[1, :s][None, :, None, :].to(xq.dtype)

    def rot(x):
        xr = x.reshape(*x.shape[:-1], -1, 2)
        re, im = xr[..., 0], xr[..., 1]
        return torch.stack((re * cos - im * sin, re * sin + im * cos), dim=-1).flatten(3)

    return rot(xq), rot(xk)


class SwiGLU(nn.Module):
    def __init__(self, in_features, hidden_features, out_features, bias=False):
        super().__init__()
        self.w12 = nn.Linear(in_features, 2 * hidden_features, bias=bias)
        self.w3 = nn.Linear(hidden_features, out_features, bias=bias)

    def forward(self, x):
        x1, x2 = self.w12(x).chunk(2, dim=-1)
        return self.w3(F.silu(x1) * x2)


class EncoderBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.qkv = nn.Linear(config.hidden_size, config.hidden_size * 3, bias=False)
        self.wo = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.ffn = SwiGLU(config.hidden_size, config.intermediate_size, config.hidden_size, bias=False)
        self.attention_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.ffn_norm = RMSNorm(config.hidden_size, config.norm_eps)

    def forward(self, x, attention_mask, freqs_cis):
        x = x + self._att_block(self.attention_norm(x), attention_mask, freqs_cis)
        return x + self.ffn(self.ffn_norm(x))

    def _att_block(self, x, attention_mask, freqs_cis):
        batch_size, seq_len, _ = x.shape
        xq, xk, xv = (
            self.qkv(x)
            .view(batch_size, seq_len, self.config.num_attention_heads, self.config.dim_head * 3)
            .chunk(3, axis=-1)
        )
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        attn = F.scaled_dot_product_attention(
            query=xq.transpose(1, 2), key=xk.transpose(1, 2), value=xv.transpose(1, 2),
            attn_mask=attention_mask, dropout_p=0.0,
        ).transpose(1, 2)
        return self.wo(attn.reshape(batch_size, seq_len, self.config.num_attention_heads * self.config.dim_head))


class NeoBERT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.encoder = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.register_buffer(
            "freqs_cis", precompute_freqs_cis(config.dim_head, config.max_length), persistent=False
        )
        self.transformer_encoder = nn.ModuleList(
            [EncoderBlock(config) for _ in range(config.num_hidden_layers)]
        )
        self.layer_norm = RMSNorm(config.hidden_size, config.norm_eps)

    def forward(self, input_ids, attention_mask=None):
        x = self.encoder(input_ids)
        freqs_cis = self.freqs_cis.double()
        for layer in self.transformer_encoder:
            x = layer(x, attention_mask, freqs_cis)
        return self.layer_norm(x)


class NeoBERTLMHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = NeoBERT(config)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size)

    def forward(self, input_ids, attention_mask=None):
        return self.decoder(self.model(input_ids, attention_mask))


def make_model():
    torch.manual_seed(1804)
    config = SimpleNamespace(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, dim_head=16, norm_eps=1e-5, max_length=64, pad_token_id=0,
    )
    model = NeoBERTLMHead(config)
    g = torch.Generator().manual_seed(18041)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

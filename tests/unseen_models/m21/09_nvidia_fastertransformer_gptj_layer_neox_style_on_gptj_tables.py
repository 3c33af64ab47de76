"""NVIDIA/FasterTransformer GPT-J (models/gptj/GptJ*.cc, kernels/decoder_masked_multihead_attention)
ported to torch: weights under FT's names, math as in the unfused context path.

GptJ: `pre_decoder_embedding_table`, `decoder_layers.N`, `post_decoder_layernorm` (gamma/beta) and
`post_decoder_embedding` (kernel + bias).  GptJDecoderLayer: one `pre_layernorm`, then the parallel
residual: out = x + self_attention(ln(x)) + ffn(ln(x)).  `self_attention`: `query_weight` as a
(hidden, 3, hidden) kernel (q|k|v, no bias), `attention_output_weight` (hidden, hidden) kernel, no
bias; heads 4 x 16 split from the (b, s, h, d) layout; partial rotary on the first
`rotary_embedding_dim` = 8 features of each head (fraction 0.5).  FT builds GPT-J's sin/cos with each
frequency repeated for an adjacent pair (c0, c0, c1, c1, ...) and applies them with
rotate_every_two (neox_rotary_style = false).  Scores * 1/sqrt(size_per_head), (1 - mask) * -10000
causal mask, softmax, context, output kernel.  `ffn`: intermediate (bias) -> gelu -> output (bias).
Slip: layer 1's attention was instantiated with `neox_rotary_style=True` (the flag the GPT-NeoX
path sets), so it rotates halves with the GPT-J pair-repeated tables: not a rotation.  No cache.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": [
        "decoder_layers.0.self_attention",
        "decoder_layers.1.self_attention",
        "decoder_layers.2.self_attention",
    ],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "decoder_layers.1.self_attention",
    "stage": "rotated_queries",
    "mistake": "rope_pairing",
    "style": "FasterTransformer GPT-J: (hidden, 3, hidden) query_weight kernel, parallel residual with one pre_layernorm, "
    "partial rotary 8/16 with pair-repeated tables and rotate_every_two, -10000 mask; layer 1 neox_rotary_style=True",
}


def rotate_every_two(x):
    x1 = x[..., ::2]
    x2 = x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def gptj_sincos(seq_len, rotary_dim, base=10000.0):
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    ang = torch.arange(seq_len, dtype=torch.float64)[:, None] * inv_freq[None]
    # FT / GPT-J layout: every frequency repeated for its adjacent pair
    return ang.sin().repeat_interleave(2, dim=-1), ang.cos().repeat_interleave(2, dim=-1)


def apply_rotary_embedding(x, sin, cos, rotary_dim, neox_rotary_style):
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    sin = sin.to(x.dtype)[None, :, None, :]
    cos = cos.to(x.dtype)[None, :, None, :]
    rot = rotate_half(x_rot) if neox_rotary_style else rotate_every_two(x_rot)
    return torch.cat([x_rot * cos + rot * sin, x_pass], dim=-1)


class GptJAttention(nn.Module):
    def __init__(self, cfg, neox_rotary_style=False):
        super().__init__()
        self.head_num = cfg.head_num
        self.size_per_head = cfg.size_per_head
        self.rotary_embedding_dim = cfg.rotary_embedding_dim
        self.neox_rotary_style = neox_rotary_style
        hidden = cfg.head_num * cfg.size_per_head
        self.query_weight = nn.Parameter(torch.randn(hidden, 3, hidden) / math.sqrt(hidden))
        self.attention_output_weight = nn.Parameter(torch.randn(hidden, hidden) / math.sqrt(hidden))

    def forward(self, x):
        b, s, hidden = x.shape
        qkv = torch.einsum("bsi,ito->bsto", x, self.query_weight)
        q, k, v = (qkv[:, :, i].view(b, s, self.head_num, self.size_per_head) for i in range(3))
        sin, cos = gptj_sincos(s, self.rotary_embedding_dim)
        q = apply_rotary_embedding(q, sin, cos, self.rotary_embedding_dim, self.neox_rotary_style)
        k = apply_rotary_embedding(k, sin, cos, self.rotary_embedding_dim, self.neox_rotary_style)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        qk = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(self.size_per_head))
        mask = torch.ones(s, s, dtype=x.dtype, device=x.device).tril()
        qk = qk + (1.0 - mask) * -10000.0
        probs = F.softmax(qk, dim=-1)
        ctx = torch.matmul(probs, v).transpose(1, 2).reshape(b, s, hidden)
        return ctx @ self.attention_output_weight


class GptJFfn(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        hidden = cfg.head_num * cfg.size_per_head
        self.intermediate_weight = nn.Parameter(torch.randn(hidden, cfg.inter_size) / math.sqrt(hidden))
        self.intermediate_bias = nn.Parameter(torch.zeros(cfg.inter_size))
        self.output_weight = nn.Parameter(torch.randn(cfg.inter_size, hidden) / math.sqrt(cfg.inter_size))
        self.output_bias = nn.Parameter(torch.zeros(hidden))

    def forward(self, x):
        h = F.gelu(x @ self.intermediate_weight + self.intermediate_bias, approximate="tanh")
        return h @ self.output_weight + self.output_bias


class GptJDecoderLayer(nn.Module):
    def __init__(self, cfg, neox_rotary_style):
        super().__init__()
        hidden = cfg.head_num * cfg.size_per_head
        self.pre_layernorm = nn.LayerNorm(hidden, eps=cfg.layernorm_eps)
        self.self_attention = GptJAttention(cfg, neox_rotary_style=neox_rotary_style)
        self.ffn = GptJFfn(cfg)

    def forward(self, x):
        h = self.pre_layernorm(x)
        return x + self.self_attention(h) + self.ffn(h)


class GptJ(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        hidden = cfg.head_num * cfg.size_per_head
        self.pre_decoder_embedding_table = nn.Parameter(torch.randn(cfg.vocab_size, hidden) * 0.5)
        self.decoder_layers = nn.ModuleList(
            [GptJDecoderLayer(cfg, neox_rotary_style=(i in cfg.neox_style_layers)) for i in range(cfg.num_layer)]
        )
        self.post_decoder_layernorm = nn.LayerNorm(hidden, eps=cfg.layernorm_eps)
        self.post_decoder_embedding = nn.Linear(hidden, cfg.vocab_size)

    def forward(self, input_ids):
        x = self.pre_decoder_embedding_table[input_ids]
        for layer in self.decoder_layers:
            x = layer(x)
        return self.post_decoder_embedding(self.post_decoder_layernorm(x))


def make_model():
    torch.manual_seed(2109)
    cfg = SimpleNamespace(
        vocab_size=96, head_num=4, size_per_head=16, inter_size=128, num_layer=3,
        rotary_embedding_dim=8, layernorm_eps=1e-5, neox_style_layers=[1],
    )
    model = GptJ(cfg)
    g = torch.Generator().manual_seed(21091)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model.eval()

"""zeux/calm (C++/CUDA LLM inference) Mistral-style transformer ported to PyTorch.

calm keeps weights per layer as `wq`, `wk`, `wv`, `wo`, `rms_att_weight`, `rms_ffn_weight`, `w1`,
`w2`, `w3`; here `blocks.N` holds `attn_norm`, `attn` (wq/wk/wv/wo, GQA 4/2, head 16), `ffn_norm`, `ffn`.
Rotary is calm's: each adjacent pair (x[2j], x[2j+1]) rotated by pos * base^(-2j/d) (interleaved,
base 1e6).  Every layer is a sliding-window layer: `sliding_window` = 4 (the config value, also kept on
each attention) means a query sees itself and the 3 keys before it; calm builds the key range per
query as [max(0, pos - window + 1), pos].  Scores scaled by 1/sqrt(head_dim), -inf outside the range,
softmax.
Slip: block 1's attention computes the range start as `pos - window` (the ring-buffer length calm uses
for its kv sink variant), so its queries see 5 keys.  No cache.
"""

from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["blocks.0.attn", "blocks.1.attn", "blocks.2.attn"],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "blocks.1.attn",
    "stage": "masked_scores",
    "mistake": "window_size",
    "style": "zeux/calm ported: wq/wk/wv/wo, adjacent-pair rotary base 1e6, GQA 4/2, sliding_window 4 on every layer "
    "as a per-query key range; block 1 starts the range at pos - window (5 keys)",
}


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_pairs(x, pos, base):
    # x (b, t, h, d), adjacent pairs
    d = x.shape[-1]
    freq = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.to(torch.float64)[:, None] * freq[None]
    c = ang.cos().to(x.dtype)[None, :, None, :]
    s = ang.sin().to(x.dtype)[None, :, None, :]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg, range_start_offset):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.sliding_window = cfg.sliding_window
        self.rope_theta = cfg.rope_theta
        self.range_start_offset = range_start_offset
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        pos = torch.arange(t, device=x.device)
        q = rope_pairs(self.wq(x).view(b, t, self.n_heads, self.head_dim), pos, self.rope_theta)
        k = rope_pairs(self.wk(x).view(b, t, self.n_kv_heads, self.head_dim), pos, self.rope_theta)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim)
        kvmul = self.n_heads // self.n_kv_heads
        kh = torch.arange(self.n_heads, device=x.device) // kvmul
        k, v = k[:, :, kh], v[:, :, kh]
        att = torch.einsum("bqhd,bkhd->bhqk", q, k) / (self.head_dim**0.5)
        start = (pos - self.sliding_window + self.range_start_offset).clamp(min=0)
        kpos = pos[None, :]
        ok = (kpos >= start[:, None]) & (kpos <= pos[:, None])
        att = att.masked_fill(~ok, float("-inf"))
        att = F.softmax(att, dim=-1)
        out = torch.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, -1)
        return self.wo(out)


class FFN(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg, range_start_offset):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim)
        self.attn = Attention(cfg, range_start_offset)
        self.ffn_norm = RMSNorm(cfg.dim)
        self.ffn = FFN(cfg)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.ffn(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.sliding_window = cfg.sliding_window
        self.token_embedding_table = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleList([Block(cfg, 0 if i in cfg.ring_layers else 1) for i in range(cfg.n_layers)])
        self.rms_final = RMSNorm(cfg.dim)
        self.wcls = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens):
        x = self.token_embedding_table(tokens)
        for blk in self.blocks:
            x = blk(x)
        return self.wcls(self.rms_final(x))


def make_model():
    torch.manual_seed(2007)
    cfg = SimpleNamespace(vocab_size=96, dim=64, hidden_dim=128, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16,
                          rope_theta=1000000.0, sliding_window=4, ring_layers=(1,))
    model = Transformer(cfg)
    g = torch.Generator().manual_seed(20071)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

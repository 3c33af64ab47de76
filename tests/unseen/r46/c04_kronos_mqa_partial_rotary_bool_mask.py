"""Kronos (shiyu-coder / NeoQuasar), the K-line foundation model: the decoder trunk that reads
embedded candle tokens. Pre-norm blocks (RMSNorm), MultiHeadAttentionWithRoPE with separate biased
q/k/v projections, rotate_half rotary tables built per call, causal attention either through
F.scaled_dot_product_attention or an eager path, SwiGLU feed-forward.

Configuration here: MQA 4:1 with heads of 16, rotary on the first 8 channels of each head (rotary_pct 0.5, base 50000), SDPA with the trunk's boolean causal mask.

This file: correct."""

import math

import torch
import torch.nn.functional as F
from torch import nn


class KronosConfig:
    d_model = 64
    n_heads = 4
    n_kv_heads = 1
    ff_dim = 128
    rope_base = 50000.0
    rotary_pct = 0.5
    attn_impl = "sdpa"  # "sdpa" or "eager"
    mask_style = "bool"  # "none": SDPA is_causal; "bool" / "additive": built by the model
    sliding_window = None
    max_context = 512
    key_block = 4  # eager path: keys per score block
    attn_dropout_p = 0.1
    resid_dropout_p = 0.1


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        normed = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return normed * self.weight


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryPositionalEmbedding(nn.Module):
    """Tables are rebuilt on every call in float64 and cast to the activations' dtype."""

    def __init__(self, dim, base=10000.0):
        super().__init__()
        self.dim = dim
        self.base = base

    def _tables(self, seq_len, device, dtype):
        exponent = torch.arange(0, self.dim, 2, dtype=torch.float64, device=device) / self.dim
        inv_freq = 1.0 / (self.base**exponent)
        t = torch.arange(seq_len, dtype=torch.float64, device=device)
        freqs = torch.einsum("i,j->ij", t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, q, k):
        cos, sin = self._tables(q.shape[-2], q.device, q.dtype)
        q_embed = (q * cos) + (rotate_half(q) * sin)
        k_embed = (k * cos) + (rotate_half(k) * sin)
        return q_embed, k_embed


class MultiHeadAttentionWithRoPE(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        self.n_rep = self.n_heads // self.n_kv_heads
        self.rot_dim = int(self.head_dim * cfg.rotary_pct)
        self.attn_impl = cfg.attn_impl
        self.key_block = cfg.key_block
        self.q_proj = nn.Linear(cfg.d_model, self.n_heads * self.head_dim)
        self.k_proj = nn.Linear(cfg.d_model, self.n_kv_heads * self.head_dim)
        self.v_proj = nn.Linear(cfg.d_model, self.n_kv_heads * self.head_dim)
        self.out_proj = nn.Linear(self.n_heads * self.head_dim, cfg.d_model)
        self.rotary = RotaryPositionalEmbedding(self.rot_dim, cfg.rope_base)
        self.attn_dropout_p = cfg.attn_dropout_p
        self.resid_dropout = nn.Dropout(cfg.resid_dropout_p)

    def forward(self, x, attn_mask=None):
        batch_size, seq_len, _ = x.shape
        q = self.q_proj(x).view(batch_size, seq_len, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch_size, seq_len, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch_size, seq_len, self.n_kv_heads, self.head_dim).transpose(1, 2)

        q_rot, q_pass = q[..., : self.rot_dim], q[..., self.rot_dim :]
        k_rot, k_pass = k[..., : self.rot_dim], k[..., self.rot_dim :]
        q_rot, k_rot = self.rotary(q_rot, k_rot)
        q = torch.cat((q_rot, q_pass), dim=-1)
        k = torch.cat((k_rot, k_pass), dim=-1)

        if self.n_rep > 1:
            k = k.repeat_interleave(self.n_rep, dim=1)
            v = v.repeat_interleave(self.n_rep, dim=1)

        if self.attn_impl == "sdpa":
            attn_output = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=attn_mask,
                dropout_p=self.attn_dropout_p if self.training else 0.0,
                is_causal=attn_mask is None,
            )
        else:
            # keys taken in blocks of key_block so each matmul stays small on long contexts
            key_blocks = torch.split(k, self.key_block, dim=2)
            scores = torch.cat([torch.matmul(q, kb.transpose(-2, -1)) for kb in key_blocks], dim=-1)
            scores = scores / math.sqrt(self.head_dim)
            scores = scores + attn_mask
            probs = torch.softmax(scores, dim=-1)
            probs = F.dropout(probs, p=self.attn_dropout_p, training=self.training)
            attn_output = torch.matmul(probs, v)

        attn_output = attn_output.transpose(1, 2).contiguous().view(batch_size, seq_len, -1)
        return self.resid_dropout(self.out_proj(attn_output))


class FeedForward(nn.Module):
    def __init__(self, d_model, ff_dim):
        super().__init__()
        self.w1 = nn.Linear(d_model, ff_dim, bias=False)
        self.w3 = nn.Linear(d_model, ff_dim, bias=False)
        self.w2 = nn.Linear(ff_dim, d_model, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.norm1 = RMSNorm(cfg.d_model)
        self.self_attn = MultiHeadAttentionWithRoPE(cfg)
        self.norm2 = RMSNorm(cfg.d_model)
        self.ffn = FeedForward(cfg.d_model, cfg.ff_dim)

    def forward(self, x, attn_mask=None):
        x = x + self.self_attn(self.norm1(x), attn_mask=attn_mask)
        return x + self.ffn(self.norm2(x))


class KronosTrunk(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.transformer = nn.ModuleList([TransformerBlock(cfg)])
        self.norm = RMSNorm(cfg.d_model)

    def build_attention_mask(self, seq_len, dtype, device):
        if self.cfg.mask_style == "none":
            return None
        idx = torch.arange(seq_len, device=device)
        allowed = idx[None, :] <= idx[:, None]
        if self.cfg.sliding_window is not None and seq_len > self.cfg.sliding_window:
            allowed = allowed & (idx[:, None] - idx[None, :] < self.cfg.sliding_window)
        if self.cfg.mask_style == "bool":
            return allowed[None, None]
        additive = torch.zeros(seq_len, seq_len, dtype=dtype, device=device)
        additive = additive.masked_fill(~allowed, torch.finfo(dtype).min)
        return additive[None, None]

    def forward(self, x):
        mask = self.build_attention_mask(x.shape[1], x.dtype, x.device)
        for block in self.transformer:
            x = block(x, attn_mask=mask)
        return self.norm(x)


def make_kronos_trunk():
    torch.manual_seed(4604)
    model = KronosTrunk(KronosConfig())
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.weight.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {
    "target": "make_kronos_trunk",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "transformer.0.self_attn",
    "structure": {
        "heads": 4,
        "kv_heads": 1,
        "head_dim": 16,
        "causal": True,
        "cross": False,
        "rope": {"pairing": "half", "fraction": 0.5, "base": 50000},
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "Kronos (shiyu-coder / NeoQuasar) (c04): correct: Kronos trunk: MQA 4:1, partial "
    "rotate_half rotary (first 8 of 16 channels, base 5e4), SDPA with a model-built boolean "
    "causal mask",
}

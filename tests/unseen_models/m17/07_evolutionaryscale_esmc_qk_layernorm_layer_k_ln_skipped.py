"""EvolutionaryScale ESM C (esm/models/esmc.py, esm/layers/{attention,blocks,transformer_stack}.py).

ESMC: embed, transformer (TransformerStack: blocks.N = UnifiedTransformerBlock, final bias-free
LayerNorm `norm`), sequence_head (Linear, GELU, LayerNorm, Linear).  UnifiedTransformerBlock: attn,
ffn = Sequential(LayerNorm, Linear(d, 2h, bias=False), SwiGLU, Linear(h, d, bias=False)), residuals
divided by scaling_factor = sqrt(n_layers / 36).  MultiHeadAttention: layernorm_qkv = Sequential(
LayerNorm(d), Linear(d, 3d, bias=False)) chunked into q, k, v; full-width bias-free LayerNorm q_ln and
k_ln over the whole projection (before the head split), rotary (halves, base 1e4) on (b, s, h, d) via
the flash-attn-style RotaryEmbedding, SDPA over (b, h, s, d) with the padding mask (bidirectional),
out_proj.  MHA 4x16.
Slip: layer 1's attention was built with `qk_layernorm_keys=False` (an ablation flag of this fork):
k_ln is still created (and loaded) but the forward only normalises the queries.
No cache.  Returns the sequence logits tensor.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["transformer.blocks.0.attn", "transformer.blocks.1.attn", "transformer.blocks.2.attn"],
    "kind": "multihead",
    "cache": None,
    "layer": "transformer.blocks.1.attn",
    "stage": "normed_keys",
    "mistake": "qk_norm_missing",
    "style": "EvolutionaryScale ESM C: layernorm_qkv Sequential(LayerNorm, fused Linear), full-width bias-free q_ln/k_ln "
    "before the head split, rotary halves base 1e4, SDPA bidirectional, residue scaling sqrt(L/36), SwiGLU ffn; "
    "layer 1 builds k_ln but never applies it",
}


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, base=10000.0):
        super().__init__()
        self.dim = dim
        self.base = base

    def forward(self, q, k):
        # q, k: (b, s, h, d)
        seqlen = q.shape[1]
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2, dtype=torch.float64) / self.dim))
        t = torch.arange(seqlen, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)
        cos = torch.cat((freqs.cos(), freqs.cos()), dim=-1)[None, :, None, :].to(q.dtype)
        sin = torch.cat((freqs.sin(), freqs.sin()), dim=-1)[None, :, None, :].to(q.dtype)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class MultiHeadAttention(nn.Module):
    def __init__(self, d_model, n_heads, qk_layernorm=True, qk_layernorm_keys=True):
        super().__init__()
        self.d_model = d_model
        self.n_heads = n_heads
        self.d_head = d_model // n_heads
        self.layernorm_qkv = nn.Sequential(nn.LayerNorm(d_model), nn.Linear(d_model, d_model * 3, bias=False))
        self.out_proj = nn.Linear(d_model, d_model, bias=False)
        if qk_layernorm:
            self.q_ln = nn.LayerNorm(d_model, bias=False)
            self.k_ln = nn.LayerNorm(d_model, bias=False)
        else:
            self.q_ln = nn.Identity()
            self.k_ln = nn.Identity()
        self.qk_layernorm_keys = qk_layernorm_keys
        self.rotary = RotaryEmbedding(d_model // n_heads)

    def _apply_rotary(self, q, k):
        q = q.unflatten(-1, (self.n_heads, self.d_head))
        k = k.unflatten(-1, (self.n_heads, self.d_head))
        q, k = self.rotary(q, k)
        return q.flatten(-2, -1), k.flatten(-2, -1)

    def forward(self, x, seq_id=None):
        qkv_BLD3 = self.layernorm_qkv(x)
        query_BLD, key_BLD, value_BLD = torch.chunk(qkv_BLD3, 3, dim=-1)
        query_BLD = self.q_ln(query_BLD).to(query_BLD.dtype)
        if self.qk_layernorm_keys:
            key_BLD = self.k_ln(key_BLD).to(query_BLD.dtype)
        query_BLD, key_BLD = self._apply_rotary(query_BLD, key_BLD)
        reshaper = lambda t: t.unflatten(-1, (self.n_heads, self.d_head)).transpose(1, 2)
        query_BHLD, key_BHLD, value_BHLD = map(reshaper, (query_BLD, key_BLD, value_BLD))
        if seq_id is not None:
            mask_BLL = seq_id.unsqueeze(-1) == seq_id.unsqueeze(-2)
            mask_BHLL = mask_BLL.unsqueeze(1)
            context_BHLD = F.scaled_dot_product_attention(query_BHLD, key_BHLD, value_BHLD, mask_BHLL)
        else:
            context_BHLD = F.scaled_dot_product_attention(query_BHLD, key_BHLD, value_BHLD)
        context_BLD = context_BHLD.transpose(1, 2).flatten(-2, -1)
        return self.out_proj(context_BLD)


class SwiGLU(nn.Module):
    def forward(self, x):
        x1, x2 = x.chunk(2, dim=-1)
        return F.silu(x1) * x2


def swiglu_correction_fn(expansion_ratio, d_model):
    return int(((expansion_ratio * d_model) + 255) // 256 * 256)


class UnifiedTransformerBlock(nn.Module):
    def __init__(self, d_model, n_heads, n_layers, qk_layernorm_keys=True, expansion_ratio=8 / 3):
        super().__init__()
        self.attn = MultiHeadAttention(d_model, n_heads, qk_layernorm=True, qk_layernorm_keys=qk_layernorm_keys)
        hidden = 128
        self.ffn = nn.Sequential(
            nn.LayerNorm(d_model),
            nn.Linear(d_model, hidden * 2, bias=False),
            SwiGLU(),
            nn.Linear(hidden, d_model, bias=False),
        )
        self.scaling_factor = math.sqrt(n_layers / 36)

    def forward(self, x, sequence_id=None):
        r1 = self.attn(x, sequence_id)
        x = x + r1 / self.scaling_factor
        r3 = self.ffn(x) / self.scaling_factor
        return x + r3


class TransformerStack(nn.Module):
    def __init__(self, d_model, n_heads, n_layers, keyless_layers=()):
        super().__init__()
        self.blocks = nn.ModuleList(
            [
                UnifiedTransformerBlock(d_model, n_heads, n_layers, qk_layernorm_keys=(i not in keyless_layers))
                for i in range(n_layers)
            ]
        )
        self.norm = nn.LayerNorm(d_model, bias=False)

    def forward(self, x, sequence_id=None):
        for block in self.blocks:
            x = block(x, sequence_id)
        return self.norm(x), x


class RegressionHead(nn.Sequential):
    def __init__(self, d_model, output_dim):
        super().__init__(
            nn.Linear(d_model, d_model), nn.GELU(), nn.LayerNorm(d_model), nn.Linear(d_model, output_dim)
        )


class ESMC(nn.Module):
    def __init__(self, d_model, n_heads, n_layers, vocab_size, keyless_layers=()):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.transformer = TransformerStack(d_model, n_heads, n_layers, keyless_layers)
        self.sequence_head = RegressionHead(d_model, vocab_size)

    def forward(self, sequence_tokens, sequence_id=None):
        x = self.embed(sequence_tokens)
        x, _ = self.transformer(x, sequence_id=sequence_id)
        return self.sequence_head(x)


def make_model():
    torch.manual_seed(1707)
    cfg = SimpleNamespace(d_model=64, n_heads=4, n_layers=3, vocab_size=96, keyless_layers=(1,))
    model = ESMC(cfg.d_model, cfg.n_heads, cfg.n_layers, cfg.vocab_size, cfg.keyless_layers)
    g = torch.Generator().manual_seed(17071)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                if m.bias is not None:
                    m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model.eval()

"""AllenAI Molmo's language model (molmo/olmo model code, the OLMo-1 repository lineage) in plain torch.

Molmo: `transformer.wte`, `transformer.blocks.N` (OLMoSequentialBlock), `transformer.ln_f`,
`transformer.ff_out` (untied head).  As in the OLMo-1 repository the attention is computed by the
block itself: the block holds `attn_norm`, one fused `att_proj` (q | k | v by `fused_dims`, GQA 4/2,
head 16, with bias as Molmo's Qwen2-based LLMs have it), `q_norm`/`k_norm` (LayerNorm without bias over
the whole q / k projection, applied before the heads are split and before the rotary), `rotary_emb`
(rotate-half, base 1e6), SDPA with an explicit boolean causal mask, `attn_out`, then `ff_norm`,
`ff_proj` (SwiGLU, chunked act|x) and `ff_out`.
Slip: block 1 is built from a config copy with `attention_layer_norm` left on (so `k_norm` exists)
but its key branch is guarded by `if self.config.key_layer_norm`, a flag that copy does not set: the
keys reach the rotary un-normed while the queries are normed.  No cache.
"""

from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["transformer.blocks.0", "transformer.blocks.1", "transformer.blocks.2"],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "transformer.blocks.1",
    "stage": "normed_keys",
    "mistake": "qk_norm_missing",
    "style": "Molmo / OLMo-1 repo block that computes attention itself: fused att_proj (bias) by fused_dims GQA 4/2, "
    "full-width LayerNorm q_norm/k_norm before rotate-half rotary base 1e6, SDPA boolean mask, attn_out; block 1 "
    "skips k_norm",
}


class LayerNormNoBias(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return F.layer_norm(x, (x.shape[-1],), self.weight, None, self.eps)


class RMSLayerNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, theta):
        super().__init__()
        self.dim, self.theta = dim, theta

    def rotate_half(self, x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def forward(self, q, k):
        # q, k: (b, h, t, d)
        t = q.shape[-2]
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.dim, 2, dtype=torch.float64) / self.dim))
        freqs = torch.einsum("i,j->ij", torch.arange(t, dtype=torch.float64), inv_freq)
        pos = torch.cat((freqs, freqs), dim=-1)
        sin, cos = pos.sin().to(q.dtype), pos.cos().to(q.dtype)
        return q * cos + self.rotate_half(q) * sin, k * cos + self.rotate_half(k) * sin


class OLMoSequentialBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        d = config.d_model
        self.head_dim = d // config.n_heads
        self.fused_dims = (d, config.n_kv_heads * self.head_dim, config.n_kv_heads * self.head_dim)
        self.attn_norm = RMSLayerNorm(d)
        self.att_proj = nn.Linear(d, sum(self.fused_dims), bias=config.include_bias)
        if config.attention_layer_norm:
            self.q_norm = LayerNormNoBias(d)
            self.k_norm = LayerNormNoBias(config.n_kv_heads * self.head_dim)
        self.rotary_emb = RotaryEmbedding(self.head_dim, config.rope_theta)
        self.attn_out = nn.Linear(d, d, bias=False)
        self.ff_norm = RMSLayerNorm(d)
        self.ff_proj = nn.Linear(d, 2 * config.mlp_hidden, bias=False)
        self.ff_out = nn.Linear(config.mlp_hidden, d, bias=False)

    def attention(self, q, k, v):
        B, T, C = q.shape
        dtype = k.dtype
        if self.config.attention_layer_norm:
            q = self.q_norm(q).to(dtype)
            if self.config.key_layer_norm:
                k = self.k_norm(k).to(dtype)
        q = q.view(B, T, self.config.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.config.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.config.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = self.rotary_emb(q, k)
        rep = self.config.n_heads // self.config.n_kv_heads
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.attn_out(att.transpose(1, 2).reshape(B, T, C))

    def forward(self, x):
        q, k, v = self.att_proj(self.attn_norm(x)).split(self.fused_dims, dim=-1)
        x = x + self.attention(q, k, v)
        h = self.ff_proj(self.ff_norm(x))
        h, gate = h.chunk(2, dim=-1)
        return x + self.ff_out(F.silu(gate) * h)


class Transformer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList()
        for i in range(config.n_layers):
            cfg_i = SimpleNamespace(**vars(config))
            if i in config.blocks_from_old_config:
                cfg_i.key_layer_norm = False
            self.blocks.append(OLMoSequentialBlock(cfg_i))
        self.ln_f = RMSLayerNorm(config.d_model)
        self.ff_out = nn.Linear(config.d_model, config.vocab_size, bias=False)


class Molmo(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.transformer = Transformer(config)

    def forward(self, input_ids):
        x = self.transformer.wte(input_ids)
        for block in self.transformer.blocks:
            x = block(x)
        return self.transformer.ff_out(self.transformer.ln_f(x))


def make_model():
    torch.manual_seed(2005)
    config = SimpleNamespace(vocab_size=96, d_model=64, n_heads=4, n_kv_heads=2, n_layers=3, mlp_hidden=128,
                             include_bias=True, attention_layer_norm=True, key_layer_norm=True,
                             rope_theta=1000000.0, blocks_from_old_config=(1,))
    model = Molmo(config)
    g = torch.Generator().manual_seed(20051)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (LayerNormNoBias, RMSLayerNorm)):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

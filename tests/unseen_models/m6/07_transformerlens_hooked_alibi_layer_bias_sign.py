"""A HookedTransformer in the style of TransformerLens (written from memory, in my own words):
`HookPoint` identity modules everywhere (hook_embed, blocks.N.hook_resid_pre, attn.hook_q/hook_k/
hook_v/hook_attn_scores/hook_pattern/hook_z, ...), `Embed.W_E`, `Unembed.W_U`/`b_U`, TransformerLens'
own `LayerNorm` (w, b; centre, then divide by sqrt(mean square + eps)), and `Attention` whose
weights are stored per head: W_Q/W_K/W_V (n_heads, d_model, d_head), W_O (n_heads, d_head, d_model),
b_Q/b_K/b_V (n_heads, d_head), b_O (d_model), all applied with einsum.  Scores are divided by
`attn_scale` = sqrt(d_head), a causal `mask` buffer (tril of ones, bool) picks between the scores
and the `IGNORE` buffer (−inf) with torch.where.  `positional_embedding_type = "alibi"`: no
positional embedding; each attention adds `alibi` = multiplier_h × (j − i) (i query, j key) after
the scale, with the standard geometric multipliers (4 heads: 2^-2, 2^-4, 2^-6, 2^-8).  MLP W_in/
b_in/W_out/b_out with gelu_new.  3 blocks, d_model 64, 4 heads of 16, vocab 130.  No cache.
Returns logits (batch, tokens, vocab).

Slip: block 1 is built with `attn_impl = "dense_alibi"`, a subclass that builds its own ALiBi
distance matrix as (i − j) instead of (j − i): the bias grows with distance.
`blocks.1.attn`, stage `biased_scores`, `bias_sign`.
"""

import math

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
    "stage": "biased_scores",
    "mistake": "bias_sign",
    "style": "TransformerLens HookedTransformer: HookPoints, per-head W_Q/W_K/W_V/W_O einsum weights, IGNORE buffer with "
    "torch.where, alibi positional_embedding_type; slip: block 1 builds its distance matrix as i - j",
}


class HookedTransformerConfig:
    d_model = 64
    d_head = 16
    n_heads = 4
    n_layers = 3
    d_mlp = 128
    d_vocab = 130
    n_ctx = 64
    eps = 1e-5
    positional_embedding_type = "alibi"
    attn_impls = ["standard", "dense_alibi", "standard"]


class HookPoint(nn.Module):
    def forward(self, x):
        return x


def gelu_new(x):
    return (
        0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
    )


class Embed(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.W_E = nn.Parameter(torch.randn(cfg.d_vocab, cfg.d_model) * 0.5)

    def forward(self, tokens):
        return self.W_E[tokens, :]


class Unembed(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.W_U = nn.Parameter(torch.randn(cfg.d_model, cfg.d_vocab) * 0.1)
        self.b_U = nn.Parameter(torch.zeros(cfg.d_vocab))

    def forward(self, residual):
        return torch.einsum("bpd,dv->bpv", residual, self.W_U) + self.b_U


class LayerNorm(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.eps = cfg.eps
        self.w = nn.Parameter(torch.ones(cfg.d_model))
        self.b = nn.Parameter(torch.zeros(cfg.d_model))
        self.hook_scale = HookPoint()
        self.hook_normalized = HookPoint()

    def forward(self, x):
        x = x - x.mean(-1, keepdim=True)
        scale = self.hook_scale((x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt())
        return self.hook_normalized(x / scale * self.w + self.b)


class Attention(nn.Module):
    def __init__(self, cfg, layer_id):
        super().__init__()
        self.cfg = cfg
        self.layer_id = layer_id
        h, d, dh = cfg.n_heads, cfg.d_model, cfg.d_head
        self.W_Q = nn.Parameter(torch.randn(h, d, dh) / math.sqrt(d))
        self.W_K = nn.Parameter(torch.randn(h, d, dh) / math.sqrt(d))
        self.W_V = nn.Parameter(torch.randn(h, d, dh) / math.sqrt(d))
        self.W_O = nn.Parameter(torch.randn(h, dh, d) / math.sqrt(h * dh))
        self.b_Q = nn.Parameter(0.05 * torch.randn(h, dh))
        self.b_K = nn.Parameter(0.05 * torch.randn(h, dh))
        self.b_V = nn.Parameter(0.05 * torch.randn(h, dh))
        self.b_O = nn.Parameter(0.05 * torch.randn(d))
        self.register_buffer("mask", torch.tril(torch.ones((cfg.n_ctx, cfg.n_ctx)).bool()))
        self.register_buffer("IGNORE", torch.tensor(-torch.inf))
        self.attn_scale = math.sqrt(dh)
        self.alibi = None
        for name in [
            "hook_q",
            "hook_k",
            "hook_v",
            "hook_attn_scores",
            "hook_pattern",
            "hook_z",
            "hook_result",
        ]:
            setattr(self, name, HookPoint())

    @staticmethod
    def create_alibi_slope(n_ctx):
        rows = torch.arange(n_ctx).unsqueeze(1)
        cols = torch.arange(n_ctx).unsqueeze(0)
        return (cols - rows).tril().to(torch.float64)  # j - i <= 0 below the diagonal

    @staticmethod
    def create_alibi_multipliers(n_heads):
        ratio = 2 ** (-8.0 / n_heads)
        return ratio ** torch.arange(1, n_heads + 1, dtype=torch.float64)

    def create_alibi_bias(self, n_ctx):
        slope = self.create_alibi_slope(n_ctx)
        multipliers = self.create_alibi_multipliers(self.cfg.n_heads)
        return torch.einsum("ij,k->kij", slope, multipliers)

    def apply_causal_mask(self, attn_scores):
        query_ctx, key_ctx = attn_scores.size(-2), attn_scores.size(-1)
        final_mask = self.mask[None, None, -query_ctx:, -key_ctx:]
        return torch.where(final_mask, attn_scores, self.IGNORE.to(attn_scores.dtype))

    def forward(self, query_input, key_input, value_input):
        q = self.hook_q(torch.einsum("bpm,hmd->bphd", query_input, self.W_Q) + self.b_Q)
        k = self.hook_k(torch.einsum("bpm,hmd->bphd", key_input, self.W_K) + self.b_K)
        v = self.hook_v(torch.einsum("bpm,hmd->bphd", value_input, self.W_V) + self.b_V)
        attn_scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / self.attn_scale
        if self.cfg.positional_embedding_type == "alibi":
            query_ctx, key_ctx = attn_scores.size(-2), attn_scores.size(-1)
            if self.alibi is None or key_ctx > self.alibi.size(-1):
                self.alibi = self.create_alibi_bias(max(key_ctx, self.cfg.n_ctx))
            attn_scores = attn_scores + self.alibi[:, :query_ctx, :key_ctx].to(attn_scores.dtype)
        attn_scores = self.hook_attn_scores(self.apply_causal_mask(attn_scores))
        pattern = self.hook_pattern(F.softmax(attn_scores, dim=-1))
        z = self.hook_z(torch.einsum("bkhd,bhqk->bqhd", v, pattern))
        return torch.einsum("bqhd,hdm->bqm", z, self.W_O) + self.b_O


class DenseAlibiAttention(Attention):
    """Variant that builds the full distance matrix itself (used by the dense_alibi blocks)."""

    @staticmethod
    def create_alibi_slope(n_ctx):
        pos = torch.arange(n_ctx)
        distance = pos[:, None] - pos[None, :]
        return distance.tril().to(torch.float64)


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.W_in = nn.Parameter(torch.randn(cfg.d_model, cfg.d_mlp) / math.sqrt(cfg.d_model))
        self.b_in = nn.Parameter(torch.zeros(cfg.d_mlp))
        self.W_out = nn.Parameter(torch.randn(cfg.d_mlp, cfg.d_model) / math.sqrt(cfg.d_mlp))
        self.b_out = nn.Parameter(torch.zeros(cfg.d_model))
        self.hook_pre = HookPoint()
        self.hook_post = HookPoint()

    def forward(self, x):
        pre = self.hook_pre(torch.einsum("bpd,dm->bpm", x, self.W_in) + self.b_in)
        post = self.hook_post(gelu_new(pre))
        return torch.einsum("bpm,md->bpd", post, self.W_out) + self.b_out


class TransformerBlock(nn.Module):
    def __init__(self, cfg, block_index):
        super().__init__()
        self.ln1 = LayerNorm(cfg)
        attn_cls = (
            DenseAlibiAttention if cfg.attn_impls[block_index] == "dense_alibi" else Attention
        )
        self.attn = attn_cls(cfg, block_index)
        self.ln2 = LayerNorm(cfg)
        self.mlp = MLP(cfg)
        self.hook_resid_pre = HookPoint()
        self.hook_attn_out = HookPoint()
        self.hook_resid_mid = HookPoint()
        self.hook_mlp_out = HookPoint()
        self.hook_resid_post = HookPoint()

    def forward(self, resid_pre):
        resid_pre = self.hook_resid_pre(resid_pre)
        normed = self.ln1(resid_pre)
        attn_out = self.hook_attn_out(self.attn(normed, normed, normed))
        resid_mid = self.hook_resid_mid(resid_pre + attn_out)
        mlp_out = self.hook_mlp_out(self.mlp(self.ln2(resid_mid)))
        return self.hook_resid_post(resid_mid + mlp_out)


class HookedTransformer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed = Embed(cfg)
        self.hook_embed = HookPoint()
        self.blocks = nn.ModuleList([TransformerBlock(cfg, i) for i in range(cfg.n_layers)])
        self.ln_final = LayerNorm(cfg)
        self.unembed = Unembed(cfg)

    def forward(self, tokens, return_type="logits"):
        residual = self.hook_embed(self.embed(tokens))
        for block in self.blocks:
            residual = block(residual)
        logits = self.unembed(self.ln_final(residual))
        return logits if return_type == "logits" else None


def make_model():
    torch.manual_seed(6107)
    model = HookedTransformer(HookedTransformerConfig())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LayerNorm):
                m.w.copy_(1.0 + 0.3 * torch.randn_like(m.w))
                m.b.copy_(0.1 * torch.randn_like(m.b))
    return model.eval()

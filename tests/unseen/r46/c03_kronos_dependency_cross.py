"""Kronos (shiyu-coder / NeoQuasar): the DependencyAwareLayer that conditions the fine (s2) token
head on the coarse (s1) token: a cross-attention whose queries come from the s1 sibling embedding and
whose keys and values come from the trunk's output, then a residual and RMSNorm. Separate biased
q/k/v projections, F.scaled_dot_product_attention, non-causal at inference.

This file: correct."""

import torch
import torch.nn.functional as F
from torch import nn


class KronosConfig:
    d_model = 64
    n_heads = 4
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


class MultiHeadCrossAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        self.q_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.k_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.v_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.out_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.attn_dropout_p = cfg.attn_dropout_p
        self.resid_dropout = nn.Dropout(cfg.resid_dropout_p)

    def forward(self, query, key, value):
        batch_size, q_len, _ = query.shape
        kv_len = key.shape[1]
        q = self.q_proj(query).view(batch_size, q_len, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(key).view(batch_size, kv_len, self.n_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(value).view(batch_size, kv_len, self.n_heads, self.head_dim).transpose(1, 2)
        attn_output = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.attn_dropout_p if self.training else 0.0, is_causal=False
        )
        attn_output = attn_output.transpose(1, 2).contiguous().view(batch_size, q_len, -1)
        return self.resid_dropout(self.out_proj(attn_output))


class DependencyAwareLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cross_attn = MultiHeadCrossAttention(cfg)
        self.norm = RMSNorm(cfg.d_model)

    def forward(self, hidden_states, sibling_embed):
        attn_out = self.cross_attn(query=sibling_embed, key=hidden_states, value=hidden_states)
        return self.norm(sibling_embed + attn_out)


class KronosS2Conditioner(nn.Module):
    """Takes (s1 sibling embeddings, trunk context) and returns the conditioned s2 features."""

    def __init__(self, cfg):
        super().__init__()
        self.dep_layer = DependencyAwareLayer(cfg)
        self.head_norm = RMSNorm(cfg.d_model)

    def forward(self, sibling_embed, context):
        return self.head_norm(self.dep_layer(context, sibling_embed))


def make_kronos_s2_conditioner():
    torch.manual_seed(4603)
    model = KronosS2Conditioner(KronosConfig())
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.weight.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {
    "target": "make_kronos_s2_conditioner",
    "kind": "cross",
    "ok": True,
    "layer": "dep_layer.cross_attn",
    "structure": {
        "heads": 4,
        "kv_heads": 4,
        "head_dim": 16,
        "causal": False,
        "cross": True,
        "rope": None,
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "Kronos (shiyu-coder / NeoQuasar) (c03): correct: Kronos DependencyAwareLayer: s1 "
    "sibling embedding as queries, trunk context as keys/values, 4 heads of 16, SDPA, "
    "residual on the query side",
}

"""Salesforce uni2ts (Moirai / Moirai-MoE) attention stack used as a causal decoder over token ids.

MoiraiDecoderLM: in_proj (token embedding in place of the patch projection), encoder
(TransformerEncoder: layers.N = TransformerEncoderLayer, pre_norm: norm1 -> self_attn -> + x, norm2
-> ffn (GatedLinearUnitFeedForward fc1 / fc_gate / fc2, SiLU) -> + x; encoder.norm), param_proj
head.

GroupedQueryAttention: q_proj / k_proj / v_proj / out_proj without bias, 4 query heads in 2 kv
groups laid out as uni2ts' einops "(group hpg dim)": query (b, group, hpg, q, d) against key /
value (b, group, 1, kv, d), so query head h uses kv group h // hpg; per-head RMSNorm q_norm /
k_norm (before the rotation), time_qk_proj = QueryKeyProjection(RotaryProjection): rotary on "(dim
r)" interleaved pairs, base 1e4, tables float64 at call time; bool mask, masked_fill -inf. Moirai's
variate-id BinaryAttentionBias is left out (one variate: a constant per head).

Cache (hf): `out = model(prompt, use_cache=True)`, then `model(tok,
past_key_values=out.past_key_values, use_cache=True)`; logits in `out.logits`; a tuple per layer of
(key, value) after norm and rotation, (b, group, 1, s, d), concatenated on the token axis.

Slip: 3 layers; layer 2 is built with query_layout "(hpg group dim)" (the einops pattern of a port
that read the checkpoint's head order the other way round): query head h is paired with kv group h
% 2 instead of h // 2, and merged back the same way. Cached decoding agrees with its own full pass.
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
        "encoder.layers.0.self_attn",
        "encoder.layers.1.self_attn",
        "encoder.layers.2.self_attn",
    ],
    "kind": "causal-multihead",
    "cache": "hf",
    "layer": "encoder.layers.2.self_attn",
    "stage": "scores",
    "mistake": "kv_group_mapping",
    "style": "uni2ts as 02; layer 2 splits its queries as (hpg group dim): head h uses kv "
    "group h % 2, not h // 2",
}


class RMSNorm(nn.Module):
    def __init__(self, normalized_shape, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(normalized_shape))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class RotaryProjection(nn.Module):
    """uni2ts-style rotary on (dim r) pairs: features 2i and 2i+1 turn together (float64 tables)."""

    def __init__(self, proj_width, base=10000.0):
        super().__init__()
        self.proj_width = proj_width
        self.base = base

    def forward(self, x, seq_id):
        theta = 1.0 / (
            self.base
            ** (
                torch.arange(0, self.proj_width, 2, dtype=torch.float64, device=x.device)
                / self.proj_width
            )
        )
        m_theta = seq_id.to(torch.float64)[..., None] * theta
        m_theta = m_theta.repeat_interleave(2, dim=-1)
        cos, sin = m_theta.cos().to(x.dtype), m_theta.sin().to(x.dtype)
        pairs = x.unflatten(-1, (-1, 2))
        rotated = torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)
        return x * cos + rotated * sin


class QueryKeyProjection(nn.Module):
    def __init__(self, dim, proj_layer=RotaryProjection, base=10000.0):
        super().__init__()
        self.query_proj = proj_layer(dim, base)
        self.key_proj = self.query_proj

    def forward(self, query, key, query_id, kv_id):
        return self.query_proj(query, query_id), self.key_proj(key, kv_id)


class GroupedQueryAttention(nn.Module):
    """q (b, group, hpg, q, d) against k, v (b, group, 1, kv, d): head g * hpg + j uses group g."""

    def __init__(self, config, layer_idx):
        super().__init__()
        self.dim = config.d_model
        self.num_heads = config.num_heads
        self.num_groups = config.num_groups
        self.heads_per_group = self.num_heads // self.num_groups
        self.head_dim = self.dim // self.num_heads
        self.q_proj = nn.Linear(self.dim, self.dim, bias=False)
        self.k_proj = nn.Linear(self.dim, self.head_dim * self.num_groups, bias=False)
        self.v_proj = nn.Linear(self.dim, self.head_dim * self.num_groups, bias=False)
        self.q_norm = RMSNorm(self.head_dim)
        self.k_norm = RMSNorm(self.head_dim)
        self.time_qk_proj = QueryKeyProjection(self.head_dim, base=config.rope_base)
        self.out_proj = nn.Linear(self.dim, self.dim, bias=False)
        self.query_layout = config.query_layout[layer_idx]
        self.q_norm_after_rope = config.q_norm_after_rope[layer_idx]

    def _split_query(self, q):
        b, s, _ = q.shape
        if self.query_layout == "(group hpg dim)":
            q = q.view(b, s, self.num_groups, self.heads_per_group, self.head_dim)
        else:  # "(hpg group dim)"
            q = q.view(b, s, self.heads_per_group, self.num_groups, self.head_dim).transpose(2, 3)
        return q.permute(0, 2, 3, 1, 4)

    def _merge_heads(self, out):
        b, _, _, s, _ = out.shape
        out = out.permute(0, 3, 1, 2, 4)
        if self.query_layout != "(group hpg dim)":
            out = out.transpose(2, 3)
        return out.reshape(b, s, self.dim)

    def forward(self, x, attn_mask, query_id, kv_id, layer_past=None):
        b, s, _ = x.shape
        query = self._split_query(self.q_proj(x))
        key = self.k_proj(x).view(b, s, self.num_groups, 1, self.head_dim).permute(0, 2, 3, 1, 4)
        value = self.v_proj(x).view(b, s, self.num_groups, 1, self.head_dim).permute(0, 2, 3, 1, 4)
        key = self.k_norm(key)
        if not self.q_norm_after_rope:
            query = self.q_norm(query)
        query, key = self.time_qk_proj(query, key, query_id, kv_id)
        if self.q_norm_after_rope:
            query = self.q_norm(query)
        if layer_past is not None:
            key = torch.cat([layer_past[0], key], dim=-2)
            value = torch.cat([layer_past[1], value], dim=-2)
        present = (key, value)
        scores = torch.matmul(query, key.transpose(-1, -2)) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(~attn_mask, float("-inf"))
        out = torch.matmul(F.softmax(scores, dim=-1), value)
        return self.out_proj(self._merge_heads(out)), present


class GatedLinearUnitFeedForward(nn.Module):
    def __init__(self, in_dim, hidden_dim):
        super().__init__()
        self.fc1 = nn.Linear(in_dim, hidden_dim, bias=False)
        self.fc_gate = nn.Linear(in_dim, hidden_dim, bias=False)
        self.fc2 = nn.Linear(hidden_dim, in_dim, bias=False)

    def forward(self, x):
        return self.fc2(F.silu(self.fc_gate(x)) * self.fc1(x))


class TransformerEncoderLayer(nn.Module):
    """uni2ts layer with pre_norm=True: x + sa(norm1(x)), then x + ffn(norm2(x))."""

    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = GroupedQueryAttention(config, layer_idx)
        self.ffn = GatedLinearUnitFeedForward(config.d_model, config.d_ff)
        self.norm1 = RMSNorm(config.d_model)
        self.norm2 = RMSNorm(config.d_model)

    def forward(self, x, attn_mask, query_id, kv_id, layer_past=None):
        h, present = self.self_attn(self.norm1(x), attn_mask, query_id, kv_id, layer_past)
        x = x + h
        return x + self.ffn(self.norm2(x)), present


class TransformerEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList(
            [TransformerEncoderLayer(config, i) for i in range(config.num_layers)]
        )
        self.norm = RMSNorm(config.d_model)


class MoiraiDecoderLM(nn.Module):
    """Moirai-MoE-like causal use of uni2ts' encoder stack: token embedding in, logits out."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.in_proj = nn.Embedding(config.vocab_size, config.d_model)
        self.encoder = TransformerEncoder(config)
        self.param_proj = nn.Linear(config.d_model, config.vocab_size, bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        b, s = input_ids.shape
        device = input_ids.device
        past_len = past_key_values[0][0].shape[-2] if past_key_values is not None else 0
        kv_len = past_len + s
        time_id = torch.arange(past_len, kv_len, device=device)
        kv_id = time_id
        query_id = time_id
        if self.config.mask_diagonal_offset:
            attn_mask = torch.ones(s, kv_len, dtype=torch.bool, device=device).tril(
                diagonal=past_len
            )
        else:
            attn_mask = torch.ones(s, kv_len, dtype=torch.bool, device=device).tril()
        x = self.in_proj(input_ids)
        presents = []
        for i, layer in enumerate(self.encoder.layers):
            layer_past = past_key_values[i] if past_key_values is not None else None
            x, present = layer(x, attn_mask, query_id, kv_id, layer_past)
            presents.append(present)
        logits = self.param_proj(self.encoder.norm(x))
        return SimpleNamespace(
            logits=logits, past_key_values=tuple(presents) if use_cache else None
        )


def make_model():
    torch.manual_seed(2805)
    config = SimpleNamespace(
        vocab_size=96,
        d_model=64,
        d_ff=128,
        num_heads=4,
        rope_base=10000.0,
        num_layers=3,
        num_groups=2,
        query_layout=["(group hpg dim)", "(group hpg dim)", "(hpg group dim)"],
        q_norm_after_rope=[False, False, False],
        mask_diagonal_offset=True,
    )
    model = MoiraiDecoderLM(config)
    g = torch.Generator().manual_seed(28051)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

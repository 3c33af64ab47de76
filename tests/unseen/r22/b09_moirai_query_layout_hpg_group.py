"""Salesforce uni2ts (Moirai) `GroupedQueryAttention` in a Moirai encoder layer: q_proj to
(group, heads-per-group, dim) and k/v projections to one head per group, the einops layouts
"... q (group hpg dim) -> ... group hpg q dim" and "... kv (group dim) -> ... group 1 kv dim" written
with view/permute, per-head q_norm/k_norm RMSNorm, a `QueryKeyProjection` wrapping uni2ts's
`RotaryProjection` (interleaved pairs "(dim r)", cos/sin cache indexed by the time ids, optional
`partial_factor` slice of each head), and `F.scaled_dot_product_attention` with the packed-sample
boolean mask the encoder builds from `sample_id`. Non-causal, pre-norm, GLU feed-forward.

This file: one bug: query rearranged as '... q (hpg group dim)': query head h lands in group h % 2."""

import math

import torch
import torch.nn.functional as F
from torch import nn


class MoiraiConfig:
    d_model = 64
    num_heads = 4
    num_groups = 2
    rope_base = 10000
    partial_factor = None
    max_len = 512
    d_ff = 128


class RMSNorm(nn.Module):
    def __init__(self, normalized_shape, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(normalized_shape))

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)


class RotaryProjection(nn.Module):
    def __init__(self, *, proj_width, num_heads, num_groups, max_len=512, base=10000):
        super().__init__()
        self.proj_width = proj_width
        theta = 1.0 / (base ** (torch.arange(0, proj_width, 2, dtype=torch.float64) / proj_width))
        self.register_buffer("theta", theta, persistent=False)
        self._init_freq(max_len)

    def _init_freq(self, max_len):
        position = torch.arange(max_len, dtype=torch.float64, device=self.theta.device)
        m_theta = torch.einsum("l,w->lw", position, self.theta.to(torch.float64))
        m_theta = m_theta.repeat_interleave(2, dim=-1)  # "length width -> length (width 2)"
        self.register_buffer("cos", m_theta.cos(), persistent=False)
        self.register_buffer("sin", m_theta.sin(), persistent=False)

    @staticmethod
    def _rotate(x):
        x1, x2 = x[..., 0::2], x[..., 1::2]  # "... (dim r) -> r ... dim"
        return torch.stack((-x2, x1), dim=-1).flatten(-2)

    def forward(self, x, seq_id):
        if int(seq_id.max()) + 1 > self.cos.shape[0]:
            self._init_freq(int(seq_id.max()) + 1)
        rot_cos = self.cos[seq_id].to(x.dtype)
        rot_sin = self.sin[seq_id].to(x.dtype)
        return rot_cos * x + rot_sin * self._rotate(x)


class QueryKeyProjection(nn.Module):
    def __init__(self, dim, num_heads, num_groups, kwargs, partial_factor=None):
        super().__init__()
        head_dim = dim // num_heads
        if partial_factor is not None:
            lo, hi = int(partial_factor[0] * head_dim), int(partial_factor[1] * head_dim)
            self.split_sizes = (lo, hi - lo, head_dim - hi)
        else:
            self.split_sizes = (0, head_dim, 0)
        self.query_proj = RotaryProjection(
            proj_width=self.split_sizes[1], num_heads=num_heads, num_groups=num_groups, **kwargs
        )
        self.key_proj = self.query_proj

    def forward(self, query, key, query_id, kv_id):
        # ids "... q -> ... 1 1 q" so they broadcast over (group, hpg)
        query_id = query_id[:, None, None, :]
        kv_id = kv_id[:, None, None, :]
        q_pre, q_rot, q_post = query.split(self.split_sizes, dim=-1)
        k_pre, k_rot, k_post = key.split(self.split_sizes, dim=-1)
        q_rot = self.query_proj(q_rot, seq_id=query_id)
        k_rot = self.key_proj(k_rot, seq_id=kv_id)
        query = torch.cat([q_pre, q_rot, q_post], dim=-1)
        key = torch.cat([k_pre, k_rot, k_post], dim=-1)
        return query, key


class GroupedQueryAttention(nn.Module):
    def __init__(self, dim, num_heads, num_groups, bias=False, softmax_scale=None,
                 time_qk_proj_kwargs=None, partial_factor=None):
        super().__init__()
        self.num_heads = num_heads
        self.num_groups = num_groups
        self.head_dim = dim // num_heads
        self.heads_per_group = num_heads // num_groups
        self.softmax_scale = softmax_scale or 1 / math.sqrt(self.head_dim)
        self.q_proj = nn.Linear(dim, dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.head_dim * num_groups, bias=bias)
        self.v_proj = nn.Linear(dim, self.head_dim * num_groups, bias=bias)
        self.q_norm = RMSNorm(self.head_dim)
        self.k_norm = RMSNorm(self.head_dim)
        self.time_qk_proj = QueryKeyProjection(
            dim, num_heads, num_groups, time_qk_proj_kwargs or {}, partial_factor
        )
        self.out_proj = nn.Linear(dim, dim, bias=bias)

    def _split_query(self, x):
        b, q, _ = x.shape
        # "... q (group hpg dim) -> ... group hpg q dim"
        return x.view(b, q, self.heads_per_group, self.num_groups, self.head_dim).permute(0, 3, 2, 1, 4)

    def _split_kv(self, x):
        b, kv, _ = x.shape
        # "... kv (group dim) -> ... group 1 kv dim"
        return x.view(b, kv, self.num_groups, 1, self.head_dim).permute(0, 2, 3, 1, 4)

    def forward(self, query, key, value, attn_mask, query_var_id, kv_var_id, query_time_id, kv_time_id):
        query = self._split_query(self.q_proj(query))
        key = self._split_kv(self.k_proj(key))
        value = self._split_kv(self.v_proj(value))

        query = self.q_norm(query)
        key = self.k_norm(key)
        query, key = self.time_qk_proj(query, key, query_id=query_time_id, kv_id=kv_time_id)

        key = key.expand(-1, -1, self.heads_per_group, -1, -1)
        value = value.expand(-1, -1, self.heads_per_group, -1, -1)
        attn_mask = attn_mask[:, None, None, :, :]  # "... q kv -> ... 1 1 q kv"
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, scale=self.softmax_scale)
        b, _, _, q, _ = out.shape
        # "... group hpg q dim -> ... q (group hpg dim)"
        out = out.permute(0, 3, 1, 2, 4).reshape(b, q, self.num_heads * self.head_dim)
        return self.out_proj(out)


class FeedForward(nn.Module):
    def __init__(self, in_dim, hidden_dim):
        super().__init__()
        self.fc1 = nn.Linear(in_dim, hidden_dim, bias=False)
        self.fc_gate = nn.Linear(in_dim, hidden_dim, bias=False)
        self.fc2 = nn.Linear(hidden_dim, in_dim, bias=False)

    def forward(self, x):
        return self.fc2(F.silu(self.fc_gate(x)) * self.fc1(x))


class TransformerEncoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = GroupedQueryAttention(
            config.d_model,
            config.num_heads,
            config.num_groups,
            time_qk_proj_kwargs={"max_len": config.max_len, "base": config.rope_base},
            partial_factor=config.partial_factor,
        )
        self.ffn = FeedForward(config.d_model, config.d_ff)
        self.norm1 = RMSNorm(config.d_model)
        self.norm2 = RMSNorm(config.d_model)

    def forward(self, x, attn_mask, var_id, time_id):
        h = self.norm1(x)
        x = x + self.self_attn(h, h, h, attn_mask, var_id, var_id, time_id, time_id)
        return x + self.ffn(self.norm2(x))


class TransformerEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList([TransformerEncoderLayer(config)])
        self.norm = RMSNorm(config.d_model)

    def forward(self, x):
        batch, seq_len, _ = x.shape
        sample_id = torch.ones(batch, seq_len, dtype=torch.long, device=x.device)
        time_id = torch.arange(seq_len, device=x.device).expand(batch, seq_len)
        var_id = torch.zeros(batch, seq_len, dtype=torch.long, device=x.device)
        # packed_attention_mask: tokens attend within their own sample
        attn_mask = sample_id[:, :, None] == sample_id[:, None, :]
        for layer in self.layers:
            x = layer(x, attn_mask, var_id, time_id)
        return self.norm(x)


def make_moirai_encoder():
    torch.manual_seed(2213)
    model = TransformerEncoder(MoiraiConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, RMSNorm):
                mod.weight.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {'target': 'make_moirai_encoder',
 'kind': 'multihead',
 'ok': False,
 'layer': 'layers.0.self_attn',
 'stage': 'scores',
 'mistake': 'kv_group_mapping',
 'style': 'uni2ts Moirai GroupedQueryAttention (einops group layout, per-head q/k RMSNorm, '
          "RotaryProjection, SDPA): query rearranged as '... q (hpg group dim)': query head h "
          'lands in group h % 2'}

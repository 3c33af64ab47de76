"""TripoSG (VAST-AI-Research, `triposg/models/transformers/triposg_transformer.py` and
`attention_processor.py`): the rectified-flow DiT over shape latents. Each block has self-attention
(attn1) and cross-attention to the image features (attn2), per-head QK norm (`qk_norm="rms_norm"` or
"layer_norm" on dim_head), and the checkpoint's heads-first fused layouts: `to_qkv` viewed as
(batch, tokens, heads, 3 * dim_head) and `to_kv` as (batch, tokens, heads, 2 * dim_head), then split.
Optional FlashVDM-style key selection: keys ranked by their mean score against a strided subset of the
queries and gathered (with their values) before SDPA.

This file: one bug: select_keys gathers the keys in relevance order but returns the values in their
original order: score j belongs to another key than value j."""

import torch
import torch.nn.functional as F
from torch import nn


class TripoSGConfig:
    width = 64
    num_attention_heads = 4
    attention_head_dim = 16
    cross_attention_dim = 64  # None: a self-attention-only block
    qk_norm = "rms_norm"
    attn_impl = "sdpa"  # "sdpa" or "eager" (baddbmm + softmax)
    flashvdm_topk_ratio = 1.0  # None: attend to every key


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return hidden_states * torch.rsqrt(variance + self.eps) * self.weight


class TripoSGAttention(nn.Module):
    def __init__(
        self,
        query_dim,
        cross_attention_dim=None,
        heads=8,
        dim_head=64,
        bias=True,
        qk_norm="rms_norm",
        eps=1e-6,
        attn_impl="sdpa",
        topk_ratio=None,
    ):
        super().__init__()
        self.inner_dim = heads * dim_head
        self.heads = heads
        self.is_cross_attention = cross_attention_dim is not None
        self.scale = dim_head**-0.5
        self.attn_impl = attn_impl
        self.topk_ratio = topk_ratio
        if self.is_cross_attention:
            self.to_q = nn.Linear(query_dim, self.inner_dim, bias=bias)
            self.to_kv = nn.Linear(cross_attention_dim, 2 * self.inner_dim, bias=bias)
        else:
            self.to_qkv = nn.Linear(query_dim, 3 * self.inner_dim, bias=bias)
        if qk_norm == "rms_norm":
            self.norm_q = RMSNorm(dim_head, eps=eps)
            self.norm_k = RMSNorm(dim_head, eps=eps)
        elif qk_norm == "layer_norm":
            self.norm_q = nn.LayerNorm(dim_head, eps=eps)
            self.norm_k = nn.LayerNorm(dim_head, eps=eps)
        else:
            self.norm_q = None
            self.norm_k = None
        self.to_out = nn.ModuleList(
            [nn.Linear(self.inner_dim, query_dim, bias=True), nn.Dropout(0.0)]
        )

    def select_keys(self, query, key, value):
        """FlashVDM: rank keys by their mean score against every 8th query, keep the top ones."""
        keep = max(1, int(round(key.shape[-2] * self.topk_ratio)))
        probe = query[:, :, ::8, :]
        relevance = (probe @ key.transpose(-1, -2)).mean(-2)
        index = torch.topk(relevance, k=keep, dim=-1).indices.unsqueeze(-1)
        index = index.expand(-1, -1, -1, value.shape[-1])
        key = torch.gather(key, dim=-2, index=index)
        return key, value

    def forward(self, hidden_states, encoder_hidden_states=None):
        batch_size = hidden_states.shape[0]
        if self.is_cross_attention:
            query = self.to_q(hidden_states)
            kv = self.to_kv(encoder_hidden_states)
            split_size = kv.shape[-1] // self.heads // 2
            kv = kv.view(batch_size, -1, self.heads, split_size * 2)
            key, value = torch.split(kv, split_size, dim=-1)
        else:
            qkv = self.to_qkv(hidden_states)
            split_size = qkv.shape[-1] // self.heads // 3
            qkv = qkv.view(batch_size, -1, self.heads, split_size * 3)
            query, key, value = torch.split(qkv, split_size, dim=-1)

        head_dim = key.shape[-1]
        query = query.reshape(batch_size, -1, self.heads, head_dim).transpose(1, 2)
        key = key.transpose(1, 2)
        value = value.transpose(1, 2)

        if self.norm_q is not None:
            query = self.norm_q(query)
        if self.norm_k is not None:
            key = self.norm_k(key)

        if self.topk_ratio is not None:
            key, value = self.select_keys(query, key, value)

        if self.attn_impl == "sdpa":
            hidden_states = F.scaled_dot_product_attention(
                query, key, value, dropout_p=0.0, is_causal=False, scale=self.scale
            )
        else:
            q = query.reshape(batch_size * self.heads, -1, head_dim)
            k = key.reshape(batch_size * self.heads, -1, head_dim)
            v = value.reshape(batch_size * self.heads, -1, head_dim)
            baddbmm_input = torch.zeros(
                q.shape[0], q.shape[1], k.shape[1], dtype=q.dtype, device=q.device
            )
            attention_scores = torch.baddbmm(
                baddbmm_input, q, k.transpose(-1, -2), beta=0, alpha=self.scale
            )
            attention_probs = attention_scores.softmax(dim=-1)
            hidden_states = torch.bmm(attention_probs, v).view(batch_size, self.heads, -1, head_dim)

        hidden_states = hidden_states.transpose(1, 2).reshape(batch_size, -1, self.heads * head_dim)
        hidden_states = self.to_out[0](hidden_states)
        hidden_states = self.to_out[1](hidden_states)
        return hidden_states


class FeedForward(nn.Module):
    def __init__(self, dim, mult=2):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(dim, dim * mult), nn.GELU(approximate="tanh"), nn.Linear(dim * mult, dim)
        )

    def forward(self, x):
        return self.net(x)


class DiTBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.width, eps=1e-6)
        self.attn1 = TripoSGAttention(
            cfg.width,
            heads=cfg.num_attention_heads,
            dim_head=cfg.attention_head_dim,
            qk_norm=cfg.qk_norm,
            attn_impl=cfg.attn_impl,
        )
        self.has_cross = cfg.cross_attention_dim is not None
        if self.has_cross:
            self.norm2 = nn.LayerNorm(cfg.width, eps=1e-6)
            self.attn2 = TripoSGAttention(
                cfg.width,
                cross_attention_dim=cfg.cross_attention_dim,
                heads=cfg.num_attention_heads,
                dim_head=cfg.attention_head_dim,
                qk_norm=cfg.qk_norm,
                attn_impl=cfg.attn_impl,
                topk_ratio=cfg.flashvdm_topk_ratio,
            )
        self.norm3 = nn.LayerNorm(cfg.width, eps=1e-6)
        self.ff = FeedForward(cfg.width)

    def forward(self, hidden_states, encoder_hidden_states=None):
        hidden_states = hidden_states + self.attn1(self.norm1(hidden_states))
        if self.has_cross:
            hidden_states = hidden_states + self.attn2(
                self.norm2(hidden_states), encoder_hidden_states=encoder_hidden_states
            )
        return hidden_states + self.ff(self.norm3(hidden_states))


class TripoSGDiT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.proj_in = nn.Linear(cfg.width, cfg.width)
        self.blocks = nn.ModuleList([DiTBlock(cfg)])
        self.norm_out = nn.LayerNorm(cfg.width, eps=1e-6)

    def forward(self, hidden_states, encoder_hidden_states=None):
        hidden_states = self.proj_in(hidden_states)
        for block in self.blocks:
            hidden_states = block(hidden_states, encoder_hidden_states)
        return self.norm_out(hidden_states)


def make_triposg_dit():
    torch.manual_seed(3908)
    model = TripoSGDiT(TripoSGConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, (nn.LayerNorm, RMSNorm)):
                mod.weight.uniform_(0.5, 1.5)
                if getattr(mod, "bias", None) is not None:
                    mod.bias.uniform_(-0.2, 0.2)
            elif isinstance(mod, nn.Linear) and mod.bias is not None:
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {
    "target": "make_triposg_dit",
    "kind": "cross",
    "ok": False,
    "layer": "blocks.0.attn2",
    "stage": "scores",
    "mistake": "wrong_key_index",
    "style": "TripoSG DiT cross-attention attn2 (heads-first fused to_kv, per-head QK norm) (base "
    "c08): one bug: select_keys gathers the keys in relevance order but returns the values "
    "in their original order: score j belongs to another key than value j",
}

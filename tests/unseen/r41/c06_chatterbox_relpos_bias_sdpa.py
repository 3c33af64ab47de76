"""Chatterbox (Resemble AI) T3 conditioning Perceiver attention: AttentionBlock2 with separate to_q /
to_k / to_v / proj_out linears (biases), one LayerNorm shared by both inputs, the head-splitting
AttentionQKV core (an einsum path and an F.scaled_dot_product_attention "flash" path), and an optional
T5-style RelativePositionBias (bidirectional buckets, learned per-head table, multiplied by
sqrt(head_dim)). The Perceiver uses the same block for cross-attention (latent queries over the
speech-prompt tokens) and self-attention. Here the norm and residual sit in the block and the
projections plus the core in `attn`.

This file: correct: self-attention with RelativePositionBias (32 bidirectional buckets, max distance 64, learned table times sqrt(16)) handed to SDPA as a float attn_mask"""

import math

import torch
import torch.nn.functional as F
from torch import nn


class RelativePositionBias(nn.Module):
    def __init__(self, scale, causal=False, num_buckets=32, max_distance=128, heads=8):
        super().__init__()
        self.scale = scale
        self.causal = causal
        self.num_buckets = num_buckets
        self.max_distance = max_distance
        self.relative_attention_bias = nn.Embedding(num_buckets, heads)

    @staticmethod
    def _relative_position_bucket(relative_position, causal=True, num_buckets=32, max_distance=128):
        ret = 0
        n = -relative_position
        if not causal:
            num_buckets //= 2
            ret += (n < 0).long() * num_buckets
            n = torch.abs(n)
        else:
            n = torch.max(n, torch.zeros_like(n))
        max_exact = num_buckets // 2
        is_small = n < max_exact
        val_if_large = (
            max_exact
            + (
                torch.log(n.double().clamp(min=1) / max_exact)
                / math.log(max_distance / max_exact)
                * (num_buckets - max_exact)
            ).long()
        )
        val_if_large = torch.min(val_if_large, torch.full_like(val_if_large, num_buckets - 1))
        return ret + torch.where(is_small, n, val_if_large)

    def bias(self, i, j, device):
        q_pos = torch.arange(i, dtype=torch.long, device=device)
        k_pos = torch.arange(j, dtype=torch.long, device=device)
        rel_pos = k_pos[None, :] - q_pos[:, None]
        rp_bucket = self._relative_position_bucket(
            rel_pos,
            causal=self.causal,
            num_buckets=self.num_buckets,
            max_distance=self.max_distance,
        )
        values = self.relative_attention_bias(rp_bucket)  # (i, j, heads)
        return values.permute(2, 0, 1).unsqueeze(0) * self.scale

    def forward(self, qk_dots):
        i, j = qk_dots.shape[-2:]
        return qk_dots + self.bias(i, j, qk_dots.device)


class AttentionQKV(nn.Module):
    def __init__(self, n_heads, head_dim, dropout_rate=0.1, scale=None, flash=False):
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = head_dim
        self.scale = scale if scale is not None else head_dim**-0.5
        self.flash = flash
        self.dropout_rate = dropout_rate
        self.dropout = nn.Dropout(dropout_rate)

    def forward(self, q, k, v, mask=None, rel_pos=None):
        q, k, v = [self.split_heads(tensor) for tensor in [q, k, v]]
        if self.flash:
            out = self.flash_attention(q, k, v, mask=mask, rel_pos=rel_pos)
        else:
            out = self.scaled_dot_product_attention(q, k, v, mask=mask, rel_pos=rel_pos)
        return self.combine_heads(out)

    def scaled_dot_product_attention(self, q, k, v, mask=None, rel_pos=None):
        sim = torch.einsum("bhtd,bhsd->bhts", q, k) * self.scale
        if rel_pos is not None:
            sim = rel_pos(sim)
        if mask is not None:
            sim = sim.masked_fill(mask == 0, float("-inf"))
        attn = torch.softmax(sim, dim=-1)
        attn = self.dropout(attn)
        return torch.einsum("bhts,bhsd->bhtd", attn, v)

    def flash_attention(self, q, k, v, mask=None, rel_pos=None):
        attn_mask = None
        if rel_pos is not None:
            attn_mask = rel_pos.bias(q.shape[-2], k.shape[-2], q.device).to(q.dtype)
        if mask is not None:
            pad = torch.zeros(mask.shape, dtype=q.dtype, device=q.device)
            pad = pad.masked_fill(mask == 0, float("-inf"))
            attn_mask = pad if attn_mask is None else attn_mask + pad
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=self.dropout_rate if self.training else 0.0
        )

    def split_heads(self, x):
        bs, length, _ = x.shape
        x = x.view(bs, length, self.n_heads, self.head_dim)
        return x.permute(0, 2, 1, 3)

    def combine_heads(self, x):
        bs, _, length, _ = x.shape
        x = x.permute(0, 2, 1, 3).contiguous()
        return x.view(bs, length, -1)


class PerceiverAttention(nn.Module):
    def __init__(self, channels, num_heads, relative_pos_embeddings, flash_attention, scale=None):
        super().__init__()
        head_dim = channels // num_heads
        self.to_q = nn.Linear(channels, channels)
        self.to_k = nn.Linear(channels, channels)
        self.to_v = nn.Linear(channels, channels)
        self.attention = AttentionQKV(
            num_heads, head_dim, dropout_rate=0.2, flash=flash_attention, scale=scale
        )
        self.proj_out = nn.Linear(channels, channels)
        if relative_pos_embeddings:
            self.relative_pos_embeddings = RelativePositionBias(
                scale=head_dim**0.5, causal=False, heads=num_heads, num_buckets=32, max_distance=64
            )
        else:
            self.relative_pos_embeddings = None

    def forward(self, x1, x2, mask=None):
        q = self.to_q(x1)
        k = self.to_k(x2)
        v = self.to_v(x2)
        h = self.attention(q, k, v, mask=mask, rel_pos=self.relative_pos_embeddings)
        return self.proj_out(h)


class AttentionBlock2(nn.Module):
    def __init__(
        self, channels=64, num_heads=4, relative_pos_embeddings=False, flash_attention=True
    ):
        super().__init__()
        self.channels = channels
        self.num_heads = num_heads
        self.norm = nn.LayerNorm(channels)
        self.attn = PerceiverAttention(
            channels, num_heads, relative_pos_embeddings, flash_attention
        )

    def forward(self, x1, x2=None):
        x1_norm = self.norm(x1)
        x2_norm = x1_norm if x2 is None else self.norm(x2)
        return x1 + self.attn(x1_norm, x2_norm)


def make_chatterbox_perceiver_block():
    torch.manual_seed(4106)
    block = AttentionBlock2(
        channels=64,
        num_heads=4,
        relative_pos_embeddings=True,
        flash_attention=True,
    )
    with torch.no_grad():
        block.norm.weight.uniform_(0.5, 1.5)
        block.norm.bias.uniform_(-0.2, 0.2)
        for lin in (block.attn.to_q, block.attn.to_k, block.attn.to_v, block.attn.proj_out):
            lin.bias.uniform_(-0.2, 0.2)
        if block.attn.relative_pos_embeddings is not None:
            block.attn.relative_pos_embeddings.relative_attention_bias.weight.normal_(0.0, 0.3)
    return block.eval()


EXPECT = {
    "target": "make_chatterbox_perceiver_block",
    "kind": "multihead",
    "ok": True,
    "layer": "attn",
    "structure": {
        "heads": 4,
        "kv_heads": 4,
        "head_dim": 16,
        "causal": False,
        "cross": False,
        "rope": None,
        "qk_norm": None,
        "window": None,
        "bias": "learned",
    },
    "style": "Chatterbox Perceiver AttentionBlock2 (c06_chatterbox_relpos_bias_sdpa): correct: "
    "self-attention with RelativePositionBias (32 bidirectional buckets, max distance 64, "
    "learned table times sqrt(16)) handed to SDPA as a float attn_mask",
}

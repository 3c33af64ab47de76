"""MAGI-1 (Sand AI) diffusion-transformer attention, scaled down to a 64-wide strip of video tokens.
Activations run sequence-first, (tokens, batch, width), as in the original Megatron-style code:
bias-free to_q/to_k/to_v, LayerNorm QK norms over the whole projection (before the head split),
rotary tables laid out for interleaved (adjacent) channel pairs, grouped-query attention with the
kv heads repeated along a new axis after the kv-head axis, and a biased to_out projection.

This file: one bug (base c02): block_causal_mask compares chunk ids with < instead of <=: with one frame per chunk every token loses its own key (row 0 fully masked with the dtype minimum, so it spreads uniformly)"""

import math

import torch
import torch.nn.functional as F
from torch import nn


class Magi1Config:
    hidden_size = 64
    num_heads = 8
    num_kv_heads = 2
    head_dim = 8
    rope_theta = 10000.0
    rotary_fraction = 1.0
    caption_dim = 48
    eps = 1e-5
    causal = True
    chunk_frames = 1  # block-causal attention over chunks of this many tokens


def magi_rope_tables(seq_len, rot_dim, theta, dtype, device):
    """cos/sin of shape (seq, 1, 1, rot_dim), each angle repeated for an adjacent channel pair."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, rot_dim, 2, dtype=torch.float64, device=device) / rot_dim)
    )
    pos = torch.arange(seq_len, dtype=torch.float64, device=device)
    ang = torch.outer(pos, inv_freq)
    ang = ang.repeat_interleave(2, dim=-1)
    return ang.cos()[:, None, None, :].to(dtype), ang.sin()[:, None, None, :].to(dtype)


def apply_rotary_emb(x, cos, sin):
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    x1 = x_rot[..., 0::2]
    x2 = x_rot[..., 1::2]
    swapped = torch.stack((-x2, x1), dim=-1).flatten(-2)
    return torch.cat((x_rot * cos + swapped * sin, x_pass), dim=-1)


def repeat_kv_heads(x, n_rep):
    # x: (seq, batch, kv_heads, head_dim) -> (seq, batch, kv_heads * n_rep, head_dim)
    if n_rep == 1:
        return x
    return x.unsqueeze(3).repeat(1, 1, 1, n_rep, 1).flatten(2, 3)


class Magi1SelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.heads = cfg.num_heads
        self.kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        inner, kv_inner = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.to_q = nn.Linear(cfg.hidden_size, inner, bias=False)
        self.to_k = nn.Linear(cfg.hidden_size, kv_inner, bias=False)
        self.to_v = nn.Linear(cfg.hidden_size, kv_inner, bias=False)
        self.norm_q = nn.LayerNorm(inner, eps=cfg.eps)
        self.norm_k = nn.LayerNorm(kv_inner, eps=cfg.eps)
        self.to_out = nn.Linear(inner, cfg.hidden_size, bias=True)

    def forward(self, hidden_states, rotary_emb, attention_mask=None):
        seq, batch, _ = hidden_states.shape
        query = self.norm_q(self.to_q(hidden_states)).unflatten(-1, (self.heads, self.head_dim))
        key = self.norm_k(self.to_k(hidden_states)).unflatten(-1, (self.kv_heads, self.head_dim))
        value = self.to_v(hidden_states).unflatten(-1, (self.kv_heads, self.head_dim))

        cos, sin = rotary_emb
        query = apply_rotary_emb(query, cos, sin)
        key = apply_rotary_emb(key, cos, sin)

        n_rep = self.heads // self.kv_heads
        key = repeat_kv_heads(key, n_rep)
        value = repeat_kv_heads(value, n_rep)

        # (seq, batch, heads, dim) -> (batch, heads, seq, dim)
        query, key, value = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        scores = torch.matmul(query, key.transpose(-1, -2)) / math.sqrt(self.head_dim)
        if attention_mask is not None:
            scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1)
        out = torch.matmul(probs, value)
        # (batch, heads, seq, dim) -> (seq, batch, heads * dim)
        out = out.permute(2, 0, 1, 3).flatten(2, 3)
        return self.to_out(out)


class Magi1CrossAttention(nn.Module):
    """Video tokens (queries) attend to the caption tokens (keys/values); no rotary."""

    def __init__(self, cfg):
        super().__init__()
        self.heads = cfg.num_heads
        self.kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        inner, kv_inner = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.to_q = nn.Linear(cfg.hidden_size, inner, bias=False)
        self.to_k = nn.Linear(cfg.hidden_size, kv_inner, bias=False)
        self.to_v = nn.Linear(cfg.hidden_size, kv_inner, bias=False)
        self.norm_q = nn.LayerNorm(inner, eps=cfg.eps)
        self.norm_k = nn.LayerNorm(kv_inner, eps=cfg.eps)
        self.to_out = nn.Linear(inner, cfg.hidden_size, bias=True)

    def forward(self, hidden_states, encoder_hidden_states):
        query = self.norm_q(self.to_q(hidden_states)).unflatten(-1, (self.heads, self.head_dim))
        key = self.norm_k(self.to_k(encoder_hidden_states)).unflatten(
            -1, (self.kv_heads, self.head_dim)
        )
        value = self.to_v(encoder_hidden_states).unflatten(-1, (self.kv_heads, self.head_dim))
        n_rep = self.heads // self.kv_heads
        key = repeat_kv_heads(key, n_rep)
        value = repeat_kv_heads(value, n_rep)
        query, key, value = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = F.scaled_dot_product_attention(query, key, value)
        out = out.permute(2, 0, 1, 3).flatten(2, 3)
        return self.to_out(out)


def block_causal_mask(seq_len, chunk, device):
    """True where a query may attend: keys in the same or an earlier chunk."""
    chunk_id = torch.arange(seq_len, device=device) // chunk
    return chunk_id[None, :] < chunk_id[:, None]


class Magi1Block(nn.Module):
    def __init__(self, cfg, cross):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.eps)
        if cross:
            self.attn2 = Magi1CrossAttention(cfg)
        else:
            self.attn1 = Magi1SelfAttention(cfg)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.eps)
        self.ffn = nn.Sequential(
            nn.Linear(cfg.hidden_size, 128),
            nn.GELU(approximate="tanh"),
            nn.Linear(128, cfg.hidden_size),
        )


class Magi1VideoStrip(nn.Module):
    """One MAGI-1 block on a (batch, tokens, 64) strip of latent video tokens."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.blocks = nn.ModuleList([Magi1Block(cfg, cross=False)])
        self.norm_out = nn.LayerNorm(cfg.hidden_size, eps=cfg.eps)

    def forward(self, x):
        seq = x.shape[1]
        h = self.patch_embed(x).transpose(0, 1)  # sequence-first
        rot_dim = int(self.cfg.head_dim * self.cfg.rotary_fraction)
        rotary_emb = magi_rope_tables(seq, rot_dim, self.cfg.rope_theta, h.dtype, h.device)
        mask = None
        if self.cfg.causal:
            mask = block_causal_mask(seq, self.cfg.chunk_frames, h.device)
        for blk in self.blocks:
            h = h + blk.attn1(blk.norm1(h), rotary_emb, attention_mask=mask)
            h = h + blk.ffn(blk.norm2(h))
        return self.norm_out(h).transpose(0, 1)


class Magi1CaptionStrip(nn.Module):
    """One MAGI-1 cross-attention branch: video tokens read the projected caption."""

    def __init__(self, cfg):
        super().__init__()
        self.patch_embed = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.y_proj_xattn = nn.Sequential(nn.Linear(cfg.hidden_size, cfg.hidden_size), nn.SiLU())
        self.blocks = nn.ModuleList([Magi1Block(cfg, cross=True)])
        self.norm_out = nn.LayerNorm(cfg.hidden_size, eps=cfg.eps)

    def forward(self, x, caption):
        h = self.patch_embed(x).transpose(0, 1)
        y = self.y_proj_xattn(caption).transpose(0, 1)
        for blk in self.blocks:
            h = h + blk.attn2(blk.norm1(h), y)
            h = h + blk.ffn(blk.norm2(h))
        return self.norm_out(h).transpose(0, 1)


def make_magi1_video_strip():
    torch.manual_seed(4502)
    cfg = Magi1Config()
    model = Magi1VideoStrip(cfg)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
            elif isinstance(mod, nn.Linear) and mod.bias is not None:
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {
    "target": "make_magi1_video_strip",
    "kind": "causal-multihead",
    "ok": False,
    "layer": "blocks.0.attn1",
    "stage": "masked_scores",
    "mistake": "mask_diagonal",
    "style": "MAGI-1 (Sand AI) (b05_magi1_chunk_mask_strict): (base c02) one bug: block_causal_mask "
    "compares chunk ids with < instead of <=: with one frame per chunk every token loses its "
    "own key (row 0 fully masked with the dtype minimum, so it spreads uniformly)",
}

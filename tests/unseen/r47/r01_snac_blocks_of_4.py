"""SNAC (hubertsiuzdak): SNAC's LocalMHA (Multi-Scale Neural Audio Codec): fused bias-free to_qkv chunked in three, einops '(h d)' head split, SinusoidalEmbeddings rotary (cat((freqs, freqs)), rotate_half via rearrange '(r d)'), optional xPos scale, bias-free to_out; the LayerNorm and residual sit in the wrapping block.

This file: refused: SNAC's actual LocalMHA windows: non-overlapping windows of 4 frames (block-diagonal), a frame sees only the frames of its own window."""

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn


class SinusoidalEmbeddings(nn.Module):
    def __init__(self, dim, scale_base=None, theta=10000):
        super().__init__()
        self.dim = dim
        self.theta = theta
        self.scale_base = scale_base

    def forward(self, x):
        seq_len, device = x.shape[-2], x.device
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.dim, 2, dtype=torch.float64, device=device) / self.dim))
        t = torch.arange(seq_len, dtype=torch.float64, device=device)
        freqs = torch.einsum("i,j->ij", t, inv_freq)
        freqs = torch.cat((freqs, freqs), dim=-1)
        if self.scale_base is None:
            return freqs.to(x.dtype), 1.0
        scale = (torch.arange(0, self.dim, 2, dtype=torch.float64, device=device) + 0.4 * self.dim) / (1.4 * self.dim)
        power = (t - (seq_len // 2)) / self.scale_base
        scale = scale[None, :] ** power[:, None]
        scale = torch.cat((scale, scale), dim=-1)
        return freqs.to(x.dtype), scale.to(x.dtype)


def rotate_half(x):
    x = rearrange(x, "b ... (r d) -> b ... r d", r=2)
    x1, x2 = x.unbind(dim=-2)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, freqs, scale=1):
    q_len = q.shape[-2]
    q_freqs = freqs[..., -q_len:, :]
    inv_scale = scale**-1
    if isinstance(scale, torch.Tensor) and scale.ndim == 2:
        scale = scale[-q_len:, :]
    q = (q * q_freqs.cos() * scale) + (rotate_half(q) * q_freqs.sin() * scale)
    k = (k * freqs.cos() * inv_scale) + (rotate_half(k) * freqs.sin() * inv_scale)
    return q, k


class LocalMHA(nn.Module):
    def __init__(self, dim=64, window_size=4, dim_head=16, use_rotary_pos_emb=True):
        super().__init__()
        self.dim = dim
        self.dim_head = dim_head
        self.heads = dim // dim_head
        self.window_size = window_size
        self.to_qkv = nn.Linear(dim, dim * 3, bias=False)
        if use_rotary_pos_emb:
            self.rel_pos = SinusoidalEmbeddings(dim_head, scale_base=None)
        else:
            self.rel_pos = None
        self.to_out = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.to_qkv(x).chunk(3, dim=-1)
        q, k, v = map(lambda t: rearrange(t, "b n (h d) -> b h n d", h=self.heads), (q, k, v))
        if self.rel_pos is not None:
            pos_emb, scale = self.rel_pos(k)
            q, k = apply_rotary_pos_emb(q, k, pos_emb, scale)
        # non-overlapping windows (SNAC's rearrange into (w n)), written as a block mask so any T works
        block = torch.arange(T, device=x.device) // self.window_size
        same_window = block[:, None] == block[None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=same_window)
        out = rearrange(out, "b h n d -> b n (h d)")
        return self.to_out(out)


class SnacAttentionBlock(nn.Module):
    """LocalMHA's pre-norm and residual, held by the block (channels-last)."""

    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = LocalMHA(dim)

    def forward(self, x):
        return x + self.attn(self.norm(x))


class SnacDecoderStrip(nn.Module):
    def __init__(self, dim=64):
        super().__init__()
        self.in_proj = nn.Conv1d(dim, dim, kernel_size=1)
        self.blocks = nn.ModuleList([SnacAttentionBlock(dim)])

    def forward(self, x):
        # (batch, frames, channels) -> conv on (batch, channels, frames) -> back to channels-last
        x = self.in_proj(x.transpose(1, 2)).transpose(1, 2)
        for block in self.blocks:
            x = block(x)
        return x


def make_snac_decoder():
    torch.manual_seed(4749)
    model = SnacDecoderStrip(64)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()

EXPECT = {
    "target": "make_snac_decoder",
    "kind": "multihead",
    "ok": True,
    "layer": "blocks.0.attn",
    "unsupported": "block_local_windows",
    "style": "SNAC (hubertsiuzdak) (r01_snac_blocks_of_4): (base c08) refused: SNAC's actual LocalMHA windows: non-overlapping windows of 4 frames (block-diagonal), a frame sees only the frames of its own window"
}

"""LightningDiT (HUST-VL, the VA-VAE paper's diffusion transformer): one block on a 1-D strip of
latent tokens. timm-style Attention with a fused biased qkv Linear reshaped to (3, B, heads, N, dim),
per-head RMSNorm QK norm (use_qknorm), EVA-style rotary applied after the QK norm (frequencies
repeated pairwise, adjacent channels rotated: interleaved pairing), fused SDPA or the eager
q * scale @ k^T path, biased proj. Block: RMSNorm + adaLN modulation from a class embedding, SwiGLU.

Configuration here: 4 heads of 16, fused SDPA, rotary theta 10000.

This file: one bug: k_norm called but its result dropped: keys reach the rotary un-normalised."""

import torch
import torch.nn.functional as F
from torch import nn


class LightningDiTConfig:
    hidden_size = 64
    num_heads = 4
    mlp_ratio = 2.0
    rope_theta = 10000.0
    fused_attn = True
    num_classes = 10
    class_label = 3


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_pairs(x):
    x = x.unflatten(-1, (-1, 2))
    x1, x2 = x.unbind(dim=-1)
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


class VisionRotaryEmbeddingFast(nn.Module):
    """1-D form of EVA's rotary: tables built per call in float64, each frequency used by a pair."""

    def __init__(self, dim, theta=10000.0):
        super().__init__()
        self.dim = dim
        self.theta = theta

    def tables(self, seq_len, device, dtype):
        freqs = 1.0 / (
            self.theta
            ** (
                torch.arange(0, self.dim, 2, dtype=torch.float64, device=device)[: self.dim // 2]
                / self.dim
            )
        )
        t = torch.arange(seq_len, dtype=torch.float64, device=device)
        freqs = torch.einsum("i,f->if", t, freqs)
        freqs = freqs.repeat_interleave(2, dim=-1)
        return freqs.cos().to(dtype), freqs.sin().to(dtype)

    def forward(self, t):
        cos, sin = self.tables(t.shape[-2], t.device, t.dtype)
        return t * cos + rotate_pairs(t) * sin


class Attention(nn.Module):
    def __init__(self, dim, num_heads, qk_norm=True, fused_attn=True):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.fused_attn = fused_attn
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.q_norm = RMSNorm(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = RMSNorm(self.head_dim) if qk_norm else nn.Identity()
        self.proj = nn.Linear(dim, dim)
        self.attn_drop = nn.Dropout(0.0)
        self.proj_drop = nn.Dropout(0.0)

    def forward(self, x, rope=None):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q = self.q_norm(q)
        self.k_norm(k)
        if rope is not None:
            q = rope(q)
            k = rope(k)

        if self.fused_attn:
            x = F.scaled_dot_product_attention(q, k, v)
        else:
            q = q * self.scale
            attn = q @ k.transpose(-2, -1)
            attn = attn.softmax(dim=-1)
            attn = self.attn_drop(attn)
            x = attn @ v

        x = x.transpose(1, 2).reshape(B, N, C)
        return self.proj_drop(self.proj(x))


class SwiGLUFFN(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w12 = nn.Linear(dim, 2 * hidden)
        self.w3 = nn.Linear(hidden, dim)

    def forward(self, x):
        x1, x2 = self.w12(x).chunk(2, dim=-1)
        return self.w3(F.silu(x1) * x2)


def modulate(x, shift, scale):
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class LightningDiTBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d = cfg.hidden_size
        self.norm1 = RMSNorm(d)
        self.attn = Attention(d, cfg.num_heads, qk_norm=True, fused_attn=cfg.fused_attn)
        self.norm2 = RMSNorm(d)
        self.mlp = SwiGLUFFN(d, int(d * cfg.mlp_ratio))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(d, 6 * d))

    def forward(self, x, c, feat_rope=None):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(
            c
        ).chunk(6, dim=-1)
        x = x + gate_msa.unsqueeze(1) * self.attn(
            modulate(self.norm1(x), shift_msa, scale_msa), rope=feat_rope
        )
        return x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))


class LightningDiTStrip(nn.Module):
    """Class-conditional LightningDiT trunk on already-embedded latent tokens (fixed class label)."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.y_embedder = nn.Embedding(cfg.num_classes, cfg.hidden_size)
        self.feat_rope = VisionRotaryEmbeddingFast(cfg.hidden_size // cfg.num_heads, cfg.rope_theta)
        self.blocks = nn.ModuleList([LightningDiTBlock(cfg)])
        self.final_norm = RMSNorm(cfg.hidden_size)

    def forward(self, x):
        labels = torch.full((x.shape[0],), self.cfg.class_label, dtype=torch.long, device=x.device)
        c = self.y_embedder(labels).to(x.dtype)
        for block in self.blocks:
            x = block(x, c, feat_rope=self.feat_rope)
        return self.final_norm(x)


def make_lightningdit_strip():
    torch.manual_seed(4609)
    model = LightningDiTStrip(LightningDiTConfig())
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.weight.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {
    "target": "make_lightningdit_strip",
    "kind": "multihead",
    "ok": False,
    "layer": "blocks.0.attn",
    "stage": "normed_keys",
    "mistake": "qk_norm_missing",
    "style": "LightningDiT (HUST-VL) (b19_lightningdit_k_norm_discarded): (base c09) one bug: k_norm "
    "called but its result dropped: keys reach the rotary un-normalised",
}

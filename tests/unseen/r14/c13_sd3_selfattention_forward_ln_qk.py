"""Stable Diffusion 3 reference MMDiT (sd3 mmdit.py) image stream: SelfAttention with fused qkv,
split_qkv by reshape(B, L, 3, -1, head_dim).movedim(2, 0), per-head qk norm ln_q/ln_k over head_dim,
a module-level attention(q, k, v, heads) helper around SDPA, and proj in post_attention.
DismantledBlock calls attn.pre_attention / attention() / attn.post_attention separately, with
adaLN shift/scale/gate from a conditioning vector (the LayerNorms have no affine of their own;
the modulation supplies non-uniform per-channel scale and shift).

This file: correct (qk_norm='ln', the block calls attn.forward)."""

import math

import torch
import torch.nn.functional as F
from torch import nn


def modulate(x, shift, scale):
    if shift is None:
        shift = torch.zeros_like(scale)
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


def attention(q, k, v, heads, mask=None):
    """q, k, v: (B, L, heads * dim_head) -> (B, L, heads * dim_head), via SDPA."""
    b, _, dim_head = q.shape
    dim_head //= heads
    q, k, v = map(lambda t: t.reshape(b, -1, heads, dim_head).transpose(1, 2), (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False)
    return out.transpose(1, 2).reshape(b, -1, heads * dim_head)


class RMSNorm(nn.Module):
    def __init__(self, dim, elementwise_affine=False, eps=1e-6, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.learnable_scale = elementwise_affine
        if self.learnable_scale:
            self.weight = nn.Parameter(torch.empty(dim, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)
        self.reset_parameters()

    def reset_parameters(self):
        if self.weight is not None:
            nn.init.ones_(self.weight)

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        x = self._norm(x)
        return x * self.weight if self.learnable_scale else x


def split_qkv(qkv, head_dim):
    qkv = qkv.reshape(qkv.shape[0], qkv.shape[1], 3, -1, head_dim).movedim(2, 0)
    return qkv[0], qkv[1], qkv[2]


class SelfAttention(nn.Module):
    ATTENTION_MODES = ("torch", "math")

    def __init__(
        self,
        dim,
        num_heads=8,
        qkv_bias=False,
        qk_scale=None,
        pre_only=False,
        qk_norm=None,
        rmsnorm=False,
    ):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        if not pre_only:
            self.proj = nn.Linear(dim, dim)
        self.pre_only = pre_only
        if qk_norm == "rms":
            self.ln_q = RMSNorm(self.head_dim, elementwise_affine=True, eps=1.0e-6)
            self.ln_k = RMSNorm(self.head_dim, elementwise_affine=True, eps=1.0e-6)
        elif qk_norm == "ln":
            self.ln_q = nn.LayerNorm(self.head_dim, elementwise_affine=True, eps=1.0e-6)
            self.ln_k = nn.LayerNorm(self.head_dim, elementwise_affine=True, eps=1.0e-6)
        elif qk_norm is None:
            self.ln_q = nn.Identity()
            self.ln_k = nn.Identity()
        else:
            raise ValueError(qk_norm)

    def pre_attention(self, x):
        B, L, C = x.shape
        qkv = self.qkv(x)
        q, k, v = split_qkv(qkv, self.head_dim)
        q = self.ln_q(q).reshape(q.shape[0], q.shape[1], -1)
        k = self.ln_k(k).reshape(k.shape[0], k.shape[1], -1)
        return (q, k, v)

    def post_attention(self, x):
        assert not self.pre_only
        x = self.proj(x)
        return x

    def forward(self, x):
        q, k, v = self.pre_attention(x)
        x = attention(q, k, v, self.num_heads)
        return self.post_attention(x)


class Mlp(nn.Module):
    def __init__(self, in_features, hidden_features):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(hidden_features, in_features)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class DismantledBlock(nn.Module):
    """A DiT block with adaLN-Zero style modulation, split so attention can be run outside the block."""

    def __init__(
        self, hidden_size, num_heads, mlp_ratio=4.0, qkv_bias=False, pre_only=False, qk_norm=None
    ):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.attn = SelfAttention(
            dim=hidden_size,
            num_heads=num_heads,
            qkv_bias=qkv_bias,
            pre_only=pre_only,
            qk_norm=qk_norm,
        )
        self.norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.mlp = Mlp(hidden_size, int(hidden_size * mlp_ratio))
        self.adaLN_modulation = nn.Sequential(
            nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size, bias=True)
        )

    def pre_attention(self, x, c):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(
            c
        ).chunk(6, dim=1)
        qkv = self.attn.pre_attention(modulate(self.norm1(x), shift_msa, scale_msa))
        return qkv, (x, gate_msa, shift_mlp, scale_mlp, gate_mlp)

    def post_attention(self, attn, x, gate_msa, shift_mlp, scale_mlp, gate_mlp):
        x = x + gate_msa.unsqueeze(1) * self.attn.post_attention(attn)
        x = x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))
        return x

    def forward(self, x, c):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(
            c
        ).chunk(6, dim=1)
        x = x + gate_msa.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift_msa, scale_msa))
        x = x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))
        return x


class MMDiTLite(nn.Module):
    """The image stream of an SD3-style MMDiT with one block and a fixed learned conditioning vector."""

    def __init__(self, hidden_size=64, num_heads=4, depth=1, qk_norm="rms"):
        super().__init__()
        self.c_embed = nn.Parameter(torch.randn(1, hidden_size))
        self.joint_blocks = nn.ModuleList(
            [
                DismantledBlock(hidden_size, num_heads, qkv_bias=True, qk_norm=qk_norm)
                for _ in range(depth)
            ]
        )
        self.norm_final = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)

    def forward(self, x):
        c = self.c_embed.expand(x.shape[0], -1)
        for block in self.joint_blocks:
            x = block(x, c)
        return self.norm_final(x)


def make_mmdit():
    torch.manual_seed(1482)
    model = MMDiTLite(qk_norm="ln")
    with torch.no_grad():
        for blk in model.joint_blocks:
            blk.adaLN_modulation[1].weight.normal_(
                0.0, 0.2
            )  # not adaLN-Zero: non-trivial shift/scale/gate
            blk.adaLN_modulation[1].bias.normal_(0.0, 0.3)
            for norm in (blk.attn.ln_q, blk.attn.ln_k):
                if isinstance(norm, (RMSNorm, nn.LayerNorm)):
                    norm.weight.uniform_(0.5, 1.5)
                if isinstance(norm, nn.LayerNorm):
                    norm.bias.normal_(0.0, 0.1)
    return model.eval()


EXPECT = {
    "target": "make_mmdit",
    "kind": "multihead",
    "ok": True,
    "layer": "joint_blocks.0.attn",
    "structure": {
        "heads": 4,
        "kv_heads": 4,
        "head_dim": 16,
        "causal": False,
        "cross": False,
        "rope": None,
        "qk_norm": "per-head",
        "window": None,
        "bias": None,
    },
    "style": "SD3 SelfAttention.forward (pre_attention, attention(), post_attention) with qk_norm='ln': "
    "per-head LayerNorm over head_dim with affine; block calls self.attn(modulate(norm1(x), "
    "...))",
}

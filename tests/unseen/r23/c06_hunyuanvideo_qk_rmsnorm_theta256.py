"""HunyuanVideo (Tencent-Hunyuan/HunyuanVideo, hyvideo/modules) image-stream attention: fused
img_attn_qkv rearranged "B L (K H D) -> K B L H D" (written with view/permute), per-head
img_attn_q_norm / img_attn_k_norm RMSNorm (elementwise_affine) on the (B, L, H, D) heads, real-valued
RoPE from get_1d_rotary_pos_embed(use_real=True) (cos/sin repeat_interleave(2): interleaved pairs) with
hunyuan's pairwise rotate_half, and hyvideo's attention(q, k, v, mode=...) helper (mode "torch": SDPA
on (B, H, L, D); mode "vanilla": explicit matmul/softmax). img_attn_proj merges the heads. Non-causal.
The attention modules are grouped in one submodule (in the original they sit directly in the
double-stream block); the block keeps a pre-LayerNorm (no adaLN modulation here) and a GELU MLP.

This file: correct (4 heads of 16, per-head QK RMSNorm, interleaved real RoPE with HunyuanVideo's rope_theta 256, SDPA mode)."""

import math

import torch
import torch.nn.functional as F
from torch import nn


class HunyuanArgs:
    hidden_size = 64
    heads_num = 4
    rope_theta = 256.0
    attn_mode = "torch"
    mlp_width_ratio = 2
    max_len = 128


class RMSNorm(nn.Module):
    def __init__(self, dim, elementwise_affine=True, eps=1e-6):
        super().__init__()
        self.eps = eps
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x).type_as(x)
        if hasattr(self, "weight"):
            output = output * self.weight
        return output


def get_1d_rotary_pos_embed(dim, pos, theta=10000.0, use_real=True):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64)[: (dim // 2)] / dim))
    freqs = torch.outer(pos.to(torch.float64), freqs)
    if use_real:
        freqs_cos = freqs.cos().repeat_interleave(2, dim=1)
        freqs_sin = freqs.sin().repeat_interleave(2, dim=1)
        return freqs_cos, freqs_sin
    return torch.polar(torch.ones_like(freqs), freqs)


def reshape_for_broadcast(freqs_cis, x, head_first=False):
    cos, sin = freqs_cis
    if head_first:
        shape = [d if i == x.ndim - 2 or i == x.ndim - 1 else 1 for i, d in enumerate(x.shape)]
    else:
        shape = [d if i == 1 or i == x.ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return cos.view(*shape).to(x.dtype), sin.view(*shape).to(x.dtype)


def rotate_half(x):
    x_real, x_imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)  # [B, S, H, D//2]
    return torch.stack([-x_imag, x_real], dim=-1).flatten(3)


def apply_rotary_emb(xq, xk, freqs_cis, head_first=False):
    cos, sin = reshape_for_broadcast(freqs_cis, xq, head_first)
    xq_out = (xq * cos + rotate_half(xq) * sin).type_as(xq)
    xk_out = (xk * cos + rotate_half(xk) * sin).type_as(xk)
    return xq_out, xk_out


def attention(q, k, v, mode="torch", attn_mask=None):
    # q, k, v: [B, S, H, D]
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if mode == "torch":
        x = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=0.0, is_causal=False)
    elif mode == "vanilla":
        scale_factor = 1 / math.sqrt(q.size(-1))
        attn = (q @ k.transpose(-2, -1)) * scale_factor
        if attn_mask is not None:
            attn = attn + attn_mask
        attn = attn.softmax(dim=-1)
        x = attn @ v
    else:
        raise NotImplementedError(mode)
    x = x.transpose(1, 2)
    b, s, a, d = x.shape
    return x.reshape(b, s, -1)


class ImageAttention(nn.Module):
    def __init__(self, hidden_size, heads_num, attn_mode):
        super().__init__()
        self.heads_num = heads_num
        self.head_dim = hidden_size // heads_num
        self.attn_mode = attn_mode
        self.img_attn_qkv = nn.Linear(hidden_size, hidden_size * 3, bias=True)
        self.img_attn_q_norm = RMSNorm(self.head_dim, elementwise_affine=True, eps=1e-6)
        self.img_attn_k_norm = RMSNorm(self.head_dim, elementwise_affine=True, eps=1e-6)
        self.img_attn_proj = nn.Linear(hidden_size, hidden_size, bias=True)

    def forward(self, img, freqs_cis):
        B, L, _ = img.shape
        img_qkv = self.img_attn_qkv(img)
        # rearrange(img_qkv, "B L (K H D) -> K B L H D", K=3, H=heads_num)
        img_qkv = img_qkv.view(B, L, 3, self.heads_num, self.head_dim).permute(2, 0, 1, 3, 4)
        img_q, img_k, img_v = img_qkv[0], img_qkv[1], img_qkv[2]
        img_q = self.img_attn_q_norm(img_q).to(img_v)
        img_k = self.img_attn_k_norm(img_k).to(img_v)
        img_qq, img_kk = apply_rotary_emb(img_q, img_k, freqs_cis, head_first=False)
        img_q, img_k = img_qq, img_kk
        attn = attention(img_q, img_k, img_v, mode=self.attn_mode)
        return self.img_attn_proj(attn)


class MMImageBlock(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.img_norm1 = nn.LayerNorm(args.hidden_size, eps=1e-6)
        self.img_attn = ImageAttention(args.hidden_size, args.heads_num, args.attn_mode)
        self.img_norm2 = nn.LayerNorm(args.hidden_size, eps=1e-6)
        self.img_mlp = nn.Sequential(
            nn.Linear(args.hidden_size, args.hidden_size * args.mlp_width_ratio),
            nn.GELU(approximate="tanh"),
            nn.Linear(args.hidden_size * args.mlp_width_ratio, args.hidden_size),
        )

    def forward(self, img, freqs_cis):
        img = img + self.img_attn(self.img_norm1(img), freqs_cis)
        return img + self.img_mlp(self.img_norm2(img))


class HunyuanImageTransformer(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.double_blocks = nn.ModuleList([MMImageBlock(args)])
        self.final_norm = nn.LayerNorm(args.hidden_size, eps=1e-6)

    def get_rotary_pos_embed(self, seq_len, device):
        head_dim = self.args.hidden_size // self.args.heads_num
        pos = torch.arange(seq_len, device=device)
        return get_1d_rotary_pos_embed(head_dim, pos, theta=self.args.rope_theta, use_real=True)

    def forward(self, img):
        freqs_cis = self.get_rotary_pos_embed(img.shape[1], img.device)
        for block in self.double_blocks:
            img = block(img, freqs_cis)
        return self.final_norm(img)


def make_hunyuan_image_stream():
    torch.manual_seed(2306)
    model = HunyuanImageTransformer(HunyuanArgs())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, RMSNorm):
                mod.weight.uniform_(0.5, 1.5)
            elif isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.3, 0.3)
    return model.eval()


EXPECT = {
    "target": "make_hunyuan_image_stream",
    "kind": "multihead",
    "ok": True,
    "layer": "double_blocks.0.img_attn",
    "structure": {
        "heads": 4,
        "kv_heads": 4,
        "head_dim": 16,
        "causal": False,
        "cross": False,
        "rope": {"pairing": "interleaved", "fraction": 1.0, "base": 256},
        "qk_norm": "per-head",
        "window": None,
        "bias": None,
    },
    "style": "HunyuanVideo image-stream attention: correct (fused qkv, per-head q/k RMSNorm, interleaved real RoPE theta 256, SDPA)",
}

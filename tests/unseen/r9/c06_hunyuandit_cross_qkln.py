"""Hunyuan-DiT (Tencent, hydit/modules/attn_layers.py) CrossAttention as attn2 of a block.

q_proj on the 64-wide image tokens, a fused kv_proj on the 48-wide text states, split with
view(b, s2, 2, heads, d).unbind(2); per-head LayerNorm q_norm/k_norm (elementwise affine)
after the head split; then the non-flash path: q * scale, q @ k^T on (b, h, s, d),
softmax, @ v, merged with transpose + reshape, out_proj. No rotary on this path.
"""

import torch
from torch import nn


class CrossAttention(nn.Module):
    def __init__(
        self,
        qdim,
        kdim,
        num_heads,
        qkv_bias=True,
        qk_norm=False,
        attn_drop=0.0,
        proj_drop=0.0,
        norm_layer=nn.LayerNorm,
    ):
        super().__init__()
        self.qdim = qdim
        self.kdim = kdim
        self.num_heads = num_heads
        assert self.qdim % num_heads == 0, "self.qdim must be divisible by num_heads"
        self.head_dim = self.qdim // num_heads
        self.scale = self.head_dim**-0.5
        self.q_proj = nn.Linear(qdim, qdim, bias=qkv_bias)
        self.kv_proj = nn.Linear(kdim, 2 * qdim, bias=qkv_bias)
        self.q_norm = (
            norm_layer(self.head_dim, elementwise_affine=True, eps=1e-6)
            if qk_norm
            else nn.Identity()
        )
        self.k_norm = (
            norm_layer(self.head_dim, elementwise_affine=True, eps=1e-6)
            if qk_norm
            else nn.Identity()
        )
        self.attn_drop = nn.Dropout(attn_drop)
        self.out_proj = nn.Linear(qdim, qdim, bias=qkv_bias)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x, y, freqs_cis_img=None):
        b, s1, c = x.shape
        _, s2, c = y.shape

        q = self.q_proj(x).view(b, s1, self.num_heads, self.head_dim)
        kv = self.kv_proj(y).view(b, s2, 2, self.num_heads, self.head_dim)
        k, v = kv.unbind(dim=2)
        q = self.q_norm(q)
        k = self.k_norm(k)

        q = q * self.scale
        q = q.transpose(-2, -3).contiguous()  # b, h, s1, d
        k = k.permute(0, 2, 3, 1).contiguous()  # b, h, d, s2
        attn = q @ k
        attn = attn.softmax(dim=-1)
        attn = self.attn_drop(attn)
        context = attn @ v.transpose(-2, -3)  # b, h, s1, d
        context = context.transpose(1, 2)

        context = context.reshape(b, s1, -1)
        out = self.out_proj(context)
        out = self.proj_drop(out)
        return (out,)


class HunYuanDiTCrossPart(nn.Module):
    def __init__(self, hidden_size=64, text_states_dim=48, num_heads=4):
        super().__init__()
        self.norm3 = nn.LayerNorm(hidden_size, elementwise_affine=True, eps=1e-6)
        self.attn2 = CrossAttention(
            hidden_size, text_states_dim, num_heads=num_heads, qkv_bias=True, qk_norm=True
        )

    def forward(self, x, text_states):
        return x + self.attn2(self.norm3(x), text_states)[0]


def make_hunyuan_cross():
    torch.manual_seed(106)
    blk = HunYuanDiTCrossPart()
    with torch.no_grad():
        blk.norm3.weight.uniform_(0.5, 1.5)
        blk.norm3.bias.uniform_(-0.1, 0.1)
        for ln in (blk.attn2.q_norm, blk.attn2.k_norm):
            ln.weight.uniform_(0.5, 1.5)
            ln.bias.uniform_(-0.2, 0.2)
    return blk.eval()


EXPECT = {
    "target": "make_hunyuan_cross",
    "kind": "cross",
    "ok": True,
    "layer": "attn2",
    "structure": {
        "heads": 4,
        "kv_heads": 4,
        "head_dim": 16,
        "causal": False,
        "cross": True,
        "rope": None,
        "qk_norm": "per-head",
        "window": None,
        "bias": None,
    },
    "style": "Hunyuan-DiT CrossAttention (q_proj on 64-wide image tokens, fused kv_proj on 48-wide text states, "
    "per-head LayerNorm q_norm/k_norm with weight and bias, q * scale, permute(0, 2, 3, 1) keys), tuple output",
}

"""Step-Video-T2V DiT attention (stepvideo/modules/blocks.py): self-attention with one fused `wqkv`
viewed per head as [q | k | v], per-head RMSNorm on queries and keys (q_norm / k_norm over
head_dim), rotary position embedding with rotate_half applied per axis of a (frames, height, width)
grid (RoPE3D: the head's channels split per axis; each axis uses its own RoPE1D table), torch SDPA
or the written-out math core; cross-attention with `wq` on the video tokens and a per-head [k | v]
`wkv` on the text features, QK norm, no rotary. adaLN-style modulation from a learned table
(fixed timestep embedding).

This file: one bug (base c05_stepvideo_self_rope3d_math): softmax over dim=-2 of (b, h, s_q, s_k): normalised over the queries."""

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim, elementwise_affine=True, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if elementwise_affine else None

    def forward(self, x):
        out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return out * self.weight if self.weight is not None else out


class RoPE1D:
    def __init__(self, freq=1e4):
        self.base = freq

    def get_cos_sin(self, dim, seq_len, device, dtype):
        inv_freq = 1.0 / (self.base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        t = torch.arange(seq_len, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)
        freqs = torch.cat((freqs, freqs), dim=-1)
        return freqs.cos().to(device, dtype), freqs.sin().to(device, dtype)

    @staticmethod
    def rotate_half(x):
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
        return torch.cat((-x2, x1), dim=-1)

    def apply_rope1d(self, tokens, pos1d, cos, sin):
        cos = F.embedding(pos1d, cos)[:, :, None, :]
        sin = F.embedding(pos1d, sin)[:, :, None, :]
        return tokens * cos + self.rotate_half(tokens) * sin

    def __call__(self, tokens, positions):
        """tokens: (batch, ntokens, nheads, dim); positions: (batch, ntokens)."""
        cos, sin = self.get_cos_sin(
            tokens.size(3), int(positions.max()) + 1, tokens.device, tokens.dtype
        )
        return self.apply_rope1d(tokens, positions, cos, sin)


class RoPE3D(RoPE1D):
    def get_mesh_3d(self, rope_positions, bsz):
        f, h, w = rope_positions
        mesh = torch.cartesian_prod(torch.arange(f), torch.arange(h), torch.arange(w))
        return mesh.view(1, f * h * w, 3).expand(bsz, -1, 3)

    def __call__(self, tokens, rope_positions, ch_split):
        mesh_grid = self.get_mesh_3d(rope_positions, bsz=tokens.shape[0])
        out = []
        for i, (dim, x) in enumerate(zip(ch_split, torch.split(tokens, ch_split, dim=-1))):
            cos, sin = self.get_cos_sin(dim, int(mesh_grid.max()) + 1, tokens.device, tokens.dtype)
            out.append(self.apply_rope1d(x, mesh_grid[:, :, i].to(tokens.device), cos, sin))
        return torch.cat(out, dim=-1)


def torch_attn_func(q, k, v, attn_mask=None, causal=False):
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # b s h d -> b h s d
    x = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal)
    return x.transpose(1, 2)


def math_attn_func(q, k, v, attn_mask=None, causal=False):
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    scores = torch.matmul(q, k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    if attn_mask is not None:
        scores = scores + attn_mask
    probs = torch.softmax(scores, dim=-2)
    return torch.matmul(probs, v).transpose(1, 2)


class SelfAttention(nn.Module):
    def __init__(self, hidden_dim, head_dim, bias=False, rope="1d", attn_type="torch"):
        super().__init__()
        self.head_dim = head_dim
        self.n_heads = hidden_dim // head_dim
        self.wqkv = nn.Linear(hidden_dim, hidden_dim * 3, bias=bias)
        self.wo = nn.Linear(hidden_dim, hidden_dim, bias=bias)
        self.q_norm = RMSNorm(head_dim, elementwise_affine=True)
        self.k_norm = RMSNorm(head_dim, elementwise_affine=True)
        self.rope_kind = rope
        if rope == "3d":
            self.rope = RoPE3D(freq=1e4)
            self.rope_ch_split = [head_dim // 2, head_dim // 4, head_dim // 4]
        else:
            self.rope = RoPE1D(freq=1e4)
        self.core_attention = torch_attn_func if attn_type == "torch" else math_attn_func

    def apply_rope(self, x, rope_positions):
        if self.rope_kind == "3d":
            return self.rope(x, rope_positions, self.rope_ch_split)
        return self.rope(x, rope_positions)

    def forward(self, x, rope_positions=None, attn_mask=None):
        xqkv = self.wqkv(x)
        xqkv = xqkv.view(*x.shape[:-1], self.n_heads, 3 * self.head_dim)
        xq, xk, xv = torch.split(xqkv, [self.head_dim] * 3, dim=-1)
        xq = self.q_norm(xq)
        xk = self.k_norm(xk)
        xq = self.apply_rope(xq, rope_positions)
        xk = self.apply_rope(xk, rope_positions)
        output = self.core_attention(xq, xk, xv, attn_mask=attn_mask)
        output = output.reshape(*output.shape[:2], -1)
        return self.wo(output)


class CrossAttention(nn.Module):
    def __init__(self, hidden_dim, head_dim, bias=False):
        super().__init__()
        self.head_dim = head_dim
        self.n_heads = hidden_dim // head_dim
        self.wq = nn.Linear(hidden_dim, hidden_dim, bias=bias)
        self.wkv = nn.Linear(hidden_dim, hidden_dim * 2, bias=bias)
        self.wo = nn.Linear(hidden_dim, hidden_dim, bias=bias)
        self.q_norm = RMSNorm(head_dim, elementwise_affine=True)
        self.k_norm = RMSNorm(head_dim, elementwise_affine=True)

    def forward(self, x, encoder_hidden_states, attn_mask=None):
        xq = self.wq(x)
        xq = xq.view(*xq.shape[:-1], self.n_heads, self.head_dim)
        xkv = self.wkv(encoder_hidden_states)
        xkv = xkv.view(*xkv.shape[:-1], self.n_heads, 2 * self.head_dim)
        xk, xv = torch.split(xkv, [self.head_dim] * 2, dim=-1)
        xq = self.q_norm(xq)
        xk = self.k_norm(xk)
        output = torch_attn_func(xq, xk, xv, attn_mask=attn_mask)
        output = output.flatten(2)
        return self.wo(output)


class StepVideoSelfBlock(nn.Module):
    def __init__(self, dim=64, head_dim=16, bias=False, rope="3d", attn_type="math"):
        super().__init__()
        self.dim = dim
        self.rope_kind = rope
        self.norm1 = nn.LayerNorm(dim, eps=1e-6, elementwise_affine=False)
        self.attn1 = SelfAttention(dim, head_dim, bias=bias, rope=rope, attn_type=attn_type)
        self.scale_shift_table = nn.Parameter(torch.randn(3, dim) / dim**0.5)

    def rope_positions(self, bsz, n, device):
        if self.rope_kind == "3d":
            return (n, 1, 1)  # a strip of n latent frames of one patch each
        return torch.arange(n, device=device).unsqueeze(0).expand(bsz, -1)

    def forward(self, x):
        shift, scale, gate = self.scale_shift_table[None].chunk(3, dim=1)
        h = self.norm1(x) * (1 + scale) + shift
        h = self.attn1(h, rope_positions=self.rope_positions(x.shape[0], x.shape[1], x.device))
        return x + gate * h


class StepVideoCrossBlock(nn.Module):
    def __init__(self, dim=64, head_dim=16, bias=False):
        super().__init__()
        self.norm_ctx = nn.LayerNorm(dim, eps=1e-6)
        self.attn2 = CrossAttention(dim, head_dim, bias=bias)

    def forward(self, hidden_states, context):
        return hidden_states + self.attn2(hidden_states, self.norm_ctx(context))


def make_stepvideo_self():
    torch.manual_seed(4305)
    model = StepVideoSelfBlock()
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, RMSNorm) and mod.weight is not None:
                mod.weight.uniform_(0.5, 1.5)
            elif isinstance(mod, nn.LayerNorm) and mod.weight is not None:
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
            elif isinstance(mod, nn.Linear) and mod.bias is not None:
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {
    "target": "make_stepvideo_self",
    "kind": "multihead",
    "ok": False,
    "layer": "attn1",
    "stage": "weights",
    "mistake": "softmax_wrong_dim",
    "style": "Step-Video DiT (b22_stepvideo_math_softmax_dim_minus2): (base c05) one bug: softmax over dim=-2 of (b, h, s_q, s_k): normalised over the queries",
}

"""Moonshot Kimi-VL MoonViT vision encoder (moonshotai/Kimi-VL-A3B modeling_kimi_vl.py): packed
MoonVitEncoderLayer with a fused wqkv Linear (bias) cut by view(..., 3, heads, head_dim), Rope2DPosEmb
(complex freqs_cis, head_dim split into interleaved x/y frequency pairs, theta 10000) applied through
torch.view_as_complex, eager attention over a block-diagonal mask built from cu_seqlens (one block
per image), wo Linear, pre-norm LayerNorm block with a GELU MLP. The patch embedding is omitted: the
tokens of each image come in row-major over a grid 4 patches wide.

This file: refused (packed images: cu_seqlens every 8 tokens, block-diagonal mask; rope switched off so the mask is the only unusual feature)"""

import torch
from torch import nn


class Rope2DPosEmb(nn.Module):
    def __init__(self, dim, max_height, max_width, theta_base=10000):
        super().__init__()
        assert dim % 4 == 0, "dim must be divisible by 4"
        self.dim = dim
        self.max_height = max_height
        self.max_width = max_width
        self.theta_base = theta_base

    def get_freqs_cis(self, n_tokens, grid_width, dtype, device):
        flat_pos = torch.arange(n_tokens, device=device, dtype=torch.float64)
        x_pos = flat_pos % grid_width
        y_pos = torch.div(flat_pos, grid_width, rounding_mode="floor")
        dim_range = torch.arange(0, self.dim, 4, device=device)[: self.dim // 4].to(torch.float64)
        freqs = 1.0 / (self.theta_base ** (dim_range / self.dim))
        x_freqs = torch.outer(x_pos, freqs)
        y_freqs = torch.outer(y_pos, freqs)
        x_cis = torch.polar(torch.ones_like(x_freqs), x_freqs)
        y_cis = torch.polar(torch.ones_like(y_freqs), y_freqs)
        freqs_cis = torch.cat([x_cis.unsqueeze(-1), y_cis.unsqueeze(-1)], dim=-1)
        freqs_cis = freqs_cis.reshape(n_tokens, -1)  # (N, dim / 2), x and y pairs interleaved
        complex_dtype = torch.complex128 if dtype == torch.float64 else torch.complex64
        return freqs_cis.to(complex_dtype)


def apply_rope(xq, xk, freqs_cis):
    """xq, xk: (..., N, heads, head_dim); freqs_cis: (N, head_dim / 2)."""
    freqs_cis = freqs_cis.unsqueeze(-2)
    xq_ = torch.view_as_complex(xq.reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.reshape(*xk.shape[:-1], -1, 2))
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(-2)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(-2)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def eager_attention(q, k, v, cu_seqlens):
    """q, k, v: (batch, seq, heads, head_dim); block-diagonal over the packed images."""
    seq_length = q.shape[1]
    attention_mask = torch.zeros([seq_length, seq_length], device=q.device, dtype=torch.bool)
    for i in range(1, len(cu_seqlens)):
        lo, hi = cu_seqlens[i - 1], cu_seqlens[i]
        attention_mask[lo:hi, lo:hi] = True
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    attn_weight = q @ k.transpose(-2, -1) / (q.shape[-1] ** 0.5)
    attn_weight = attn_weight.masked_fill(~attention_mask, float("-inf"))
    attn_weight = torch.softmax(attn_weight, dim=-1)
    attn_output = attn_weight @ v
    return attn_output.transpose(1, 2).reshape(q.shape[0], seq_length, -1)


class MoonVitEncoderLayer(nn.Module):
    def __init__(self, num_heads, hidden_dim, mlp_dim, use_rope):
        super().__init__()
        self.num_heads = num_heads
        self.hidden_dim = hidden_dim
        self.hidden_size_per_attention_head = hidden_dim // num_heads
        self.use_rope = use_rope
        self.norm0 = nn.LayerNorm(hidden_dim)
        self.norm1 = nn.LayerNorm(hidden_dim)
        self.mlp = nn.Sequential(nn.Linear(hidden_dim, mlp_dim), nn.GELU(), nn.Linear(mlp_dim, hidden_dim))
        self.attn = MoonVitAttention(num_heads, hidden_dim, use_rope)

    def forward(self, hidden_states, cu_seqlens, rope_freqs_cis):
        hidden_states = hidden_states + self.attn(self.norm0(hidden_states), cu_seqlens, rope_freqs_cis)
        return hidden_states + self.mlp(self.norm1(hidden_states))


class MoonVitAttention(nn.Module):
    def __init__(self, num_heads, hidden_dim, use_rope):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = hidden_dim // num_heads
        self.use_rope = use_rope
        self.wqkv = nn.Linear(hidden_dim, hidden_dim * 3, bias=True)
        self.wo = nn.Linear(hidden_dim, hidden_dim, bias=True)

    def forward(self, x, cu_seqlens, rope_freqs_cis):
        xqkv = self.wqkv(x)
        qkv_shape = xqkv.size()[:-1] + (3, self.num_heads, self.head_dim)
        xqkv = xqkv.view(*qkv_shape)
        xq, xk, xv = torch.unbind(xqkv, dim=-3)
        if self.use_rope:
            xq, xk = apply_rope(xq, xk, rope_freqs_cis)
        attn_out = eager_attention(xq, xk, xv, cu_seqlens)
        return self.wo(attn_out)


class MoonVitEncoder(nn.Module):
    def __init__(self, hidden_dim=64, num_heads=4, grid_width=4, image_tokens=8, use_rope=False):
        super().__init__()
        self.grid_width = grid_width
        self.image_tokens = image_tokens
        self.rope_2d = Rope2DPosEmb(hidden_dim // num_heads, 64, 64)
        self.blocks = nn.ModuleList([MoonVitEncoderLayer(num_heads, hidden_dim, 2 * hidden_dim, use_rope)])
        self.final_layernorm = nn.LayerNorm(hidden_dim)

    def forward(self, hidden_states):
        n = hidden_states.shape[1]
        step = self.image_tokens or n
        cu_seqlens = list(range(0, n, step)) + [n]
        rope_freqs_cis = self.rope_2d.get_freqs_cis(
            n, self.grid_width, hidden_states.dtype, hidden_states.device
        )
        for block in self.blocks:
            hidden_states = block(hidden_states, cu_seqlens, rope_freqs_cis)
        return self.final_layernorm(hidden_states)


def make_moonvit_encoder():
    torch.manual_seed(3504)
    model = MoonVitEncoder()
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
            elif isinstance(mod, nn.Linear):
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {
    "target": "make_moonvit_encoder",
    "kind": "multihead",
    "ok": True,
    "layer": "blocks.0.attn",
    "unsupported": "packed_block_diagonal_mask",
    "style": "Kimi-VL MoonViT MoonVitEncoderLayer (moonshotai/Kimi-VL-A3B-Instruct modeling_kimi_vl.py): refused: several images packed in one sequence, cu_seqlens [0, 8, 16, ...], block-diagonal boolean mask (a token sees only its own image's 8 tokens, both directions); 4 heads of 16, no rotary in this build",
}

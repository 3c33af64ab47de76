"""Wan 2.1 WanSelfAttention: softmax_scale from the model width (96**-0.5) instead of the head width (16**-0.5)."""

import torch
import torch.nn.functional as F
from torch import nn


def rope_params(max_seq_len, dim, theta=10000):
    assert dim % 2 == 0
    freqs = torch.outer(
        torch.arange(max_seq_len),
        1.0 / torch.pow(theta, torch.arange(0, dim, 2).to(torch.float64).div(dim)),
    )
    return torch.polar(torch.ones_like(freqs), freqs)


def rope_apply(x, grid_sizes, freqs):
    n, c = x.size(2), x.size(3) // 2
    freqs = freqs.split([c - 2 * (c // 3), c // 3, c // 3], dim=1)
    output = []
    for i, (f, h, w) in enumerate(grid_sizes.tolist()):
        seq_len = f * h * w
        x_i = torch.view_as_complex(x[i, :seq_len].to(torch.float64).reshape(seq_len, n, -1, 2))
        freqs_i = torch.cat(
            [
                freqs[0][:f].view(f, 1, 1, -1).expand(f, h, w, -1),
                freqs[1][:h].view(1, h, 1, -1).expand(f, h, w, -1),
                freqs[2][:w].view(1, 1, w, -1).expand(f, h, w, -1),
            ],
            dim=-1,
        ).reshape(seq_len, 1, -1)
        x_i = torch.view_as_real(x_i * freqs_i).flatten(2)
        x_i = torch.cat([x_i, x[i, seq_len:]])
        output.append(x_i)
    return torch.stack(output).to(x.dtype)


def flash_attention(q, k, v, softmax_scale=None, causal=False):
    """Torch stand-in for flash_attn_varlen_func on (b, s, n, d) tensors."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=softmax_scale)
    return out.transpose(1, 2).contiguous()


class WanRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self._norm(x.float()).type_as(x) * self.weight

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)


class WanSelfAttention(nn.Module):
    def __init__(self, dim, num_heads, window_size=(-1, -1), qk_norm=True, eps=1e-6):
        super().__init__()
        self.dim = dim
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.window_size = window_size
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)
        self.norm_q = WanRMSNorm(dim, eps=eps) if qk_norm else nn.Identity()
        self.norm_k = WanRMSNorm(dim, eps=eps) if qk_norm else nn.Identity()

    def forward(self, x, seq_lens, grid_sizes, freqs):
        b, s, n, d = *x.shape[:2], self.num_heads, self.head_dim

        def qkv_fn(x):
            q = self.norm_q(self.q(x)).view(b, s, n, d)
            k = self.norm_k(self.k(x)).view(b, s, n, d)
            v = self.v(x).view(b, s, n, d)
            return q, k, v

        q, k, v = qkv_fn(x)
        x = flash_attention(
            q=rope_apply(q, grid_sizes, freqs),
            k=rope_apply(k, grid_sizes, freqs),
            v=v,
            softmax_scale=self.dim**-0.5,
        )
        x = x.flatten(2)
        return self.o(x)


class WanAttentionBlock(nn.Module):
    def __init__(self, dim=96, num_heads=6, eps=1e-6):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps)
        self.self_attn = WanSelfAttention(dim, num_heads, qk_norm=True, eps=eps)
        d = dim // num_heads
        self.register_buffer(
            "freqs",
            torch.cat(
                [
                    rope_params(1024, d - 4 * (d // 6)),
                    rope_params(1024, 2 * (d // 6)),
                    rope_params(1024, 2 * (d // 6)),
                ],
                dim=1,
            ),
            persistent=False,
        )

    def forward(self, x):
        b, s, _ = x.shape
        seq_lens = torch.full((b,), s, dtype=torch.long)
        grid_sizes = torch.tensor([[s, 1, 1]] * b, dtype=torch.long)
        y = self.self_attn(self.norm1(x), seq_lens, grid_sizes, self.freqs)
        return x + y


def make_wan_block():
    torch.manual_seed(1003)
    block = WanAttentionBlock()
    with torch.no_grad():
        block.norm1.weight.uniform_(0.5, 1.5)
        block.norm1.bias.uniform_(-0.2, 0.2)
        block.self_attn.norm_q.weight.uniform_(0.5, 1.5)
        block.self_attn.norm_k.weight.uniform_(0.5, 1.5)
    return block.eval()


EXPECT = {
    "target": "make_wan_block",
    "kind": "multihead",
    "ok": False,
    "layer": "self_attn",
    "stage": "scaled_scores",
    "mistake": "wrong_scale",
    "style": "Wan 2.1 WanSelfAttention: softmax_scale from the model width (96**-0.5) instead of the head "
    "width (16**-0.5)",
}

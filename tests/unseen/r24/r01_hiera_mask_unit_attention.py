"""facebookresearch/hiera (hiera.py, MaskUnitAttention inside a HieraBlock): a fused `qkv` Linear
(bias) reshaped (B, -1, num_windows, 3, heads, head_dim) and permuted (3, 0, 4, 2, 1, 5), optional
q_stride max-pooling of the queries (1 here), attention by SDPA or by the manual
(q * scale) @ k^T path, the windows and heads folded back with x.transpose(1, 3), `proj` (bias); the block is
pre-norm LayerNorm with a residual and an MLP. Not causal, no position code inside the attention.
With use_mask_unit_attn the tokens are dealt into num_windows mask units (token t in unit t % num_windows)
that attend only within themselves.

This file: refused: mask-unit attention (use_mask_unit_attn, window_size 4): tokens dealt into units t % num_windows, each unit attends only within itself (block-sparse, not a sliding window)."""

import torch
from torch import nn
import torch.nn.functional as F


class MaskUnitAttention(nn.Module):
    def __init__(self, dim, dim_out, heads, q_stride=1, window_size=0, use_mask_unit_attn=False, use_sdpa=True):
        super().__init__()
        self.dim = dim
        self.dim_out = dim_out
        self.heads = heads
        self.q_stride = q_stride
        self.head_dim = dim_out // heads
        self.scale = self.head_dim ** -0.5
        self.qkv = nn.Linear(dim, 3 * dim_out)
        self.proj = nn.Linear(dim_out, dim_out)
        self.window_size = window_size
        self.use_mask_unit_attn = use_mask_unit_attn
        self.use_sdpa = use_sdpa

    def _num_windows(self, N):
        if not self.use_mask_unit_attn:
            return 1
        # deviation: Hiera's token grid always divides evenly; here any N is accepted
        for n in (N // (self.q_stride * self.window_size), 2):
            if n >= 1 and N % n == 0:
                return n
        return 1

    def forward(self, x):
        B, N, _ = x.shape
        num_windows = self._num_windows(N)
        qkv = self.qkv(x).reshape(B, -1, num_windows, 3, self.heads, self.head_dim).permute(3, 0, 4, 2, 1, 5)
        q, k, v = qkv[0], qkv[1], qkv[2]
        if self.q_stride > 1:
            q = q.view(B, self.heads, num_windows, self.q_stride, -1, self.head_dim).max(dim=3).values
        if self.use_sdpa:
            x = F.scaled_dot_product_attention(q, k, v)
        else:
            attn = (q * self.scale) @ k.transpose(-1, -2)
            attn = attn.softmax(dim=-1)
            x = attn @ v
        x = x.transpose(1, 3).reshape(B, -1, self.dim_out)
        return self.proj(x)


class Mlp(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class HieraBlock(nn.Module):
    def __init__(self, dim, heads, window_size=0, use_mask_unit_attn=False, use_sdpa=True):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = MaskUnitAttention(dim, dim, heads, 1, window_size, use_mask_unit_attn, use_sdpa)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, 4 * dim)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def make_hiera_block():
    torch.manual_seed(2433)
    block = HieraBlock(64, 4, window_size=4, use_mask_unit_attn=True, use_sdpa=True)
    with torch.no_grad():
        for mod in block.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
    return block.eval()


EXPECT = {'target': 'make_hiera_block',
 'kind': 'multihead',
 'ok': True,
 'layer': 'attn',
 'unsupported': 'mask_unit_windows',
 'style': 'Hiera MaskUnitAttention with use_mask_unit_attn: attention inside strided mask units '
          'only'}

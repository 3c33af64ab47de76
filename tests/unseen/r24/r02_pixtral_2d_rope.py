"""Hugging Face Pixtral vision encoder (PixtralRotaryEmbedding + PixtralAttention): 2-D RoPE whose
frequencies alternate between the patch row (freqs[::2]) and the patch column (freqs[1::2]), tokens
being one image's patches in raster order on a 4-wide grid; rotate_half application, separate
q/k/v/o projections without bias, full (non-causal) attention inside the image.

This file: refused (2-D rotary positions: the rotation angle follows (row, column), not the token index)."""

import torch
from torch import nn


class PixtralVisionConfig:
    hidden_size = 64
    num_attention_heads = 4
    head_dim = 16
    rope_theta = 10000.0
    patch_grid_width = 4  # patches per image row; tokens are patches in raster order


class PixtralRotaryEmbedding(nn.Module):
    """2-D RoPE: half of the frequencies follow the patch row, the other half the patch column."""

    def __init__(self, config):
        super().__init__()
        dim = config.head_dim
        freqs = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        self.register_buffer("freqs_h", freqs[::2], persistent=False)
        self.register_buffer("freqs_w", freqs[1::2], persistent=False)
        self.width = config.patch_grid_width

    def forward(self, x, num_patches):
        idx = torch.arange(num_patches, device=x.device)
        h, w = (idx // self.width).to(torch.float64), (idx % self.width).to(torch.float64)
        inv = torch.cat([torch.outer(h, self.freqs_h), torch.outer(w, self.freqs_w)], dim=-1)
        emb = torch.cat((inv, inv), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class PixtralAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, hidden_states, position_embeddings):
        b, n, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
        cos, sin = position_embeddings
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        w = torch.softmax(torch.matmul(q, k.transpose(2, 3)) * self.scale, dim=-1)
        out = torch.matmul(w, v).transpose(1, 2).reshape(b, n, -1)
        return self.o_proj(out)


class PixtralRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class PixtralAttentionLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention_norm = PixtralRMSNorm(config.hidden_size)
        self.attention = PixtralAttention(config)

    def forward(self, x, position_embeddings):
        return x + self.attention(self.attention_norm(x), position_embeddings)


class PixtralTransformer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.patch_positional_embedding = PixtralRotaryEmbedding(config)
        self.layers = nn.ModuleList([PixtralAttentionLayer(config)])

    def forward(self, patch_embeds):
        pe = self.patch_positional_embedding(patch_embeds, patch_embeds.shape[1])
        for layer in self.layers:
            patch_embeds = layer(patch_embeds, pe)
        return patch_embeds


def make_pixtral_vision():
    torch.manual_seed(2461)
    model = PixtralTransformer(PixtralVisionConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, PixtralRMSNorm):
                mod.weight.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {'target': 'make_pixtral_vision',
 'kind': 'multihead',
 'ok': True,
 'layer': 'layers.0.attention',
 'unsupported': 'rope_2d',
 'style': 'HF Pixtral vision attention: 2-D RoPE over a 4-wide patch grid'}

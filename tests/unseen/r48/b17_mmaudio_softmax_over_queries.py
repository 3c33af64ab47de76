"""MMAudio (hkchengrex) conditioning cross-attention: the audio latents query the clip-feature
tokens. Queries from a biased q_proj, keys and values from one fused biased kv_proj on the
conditioning, per-head RMSNorm on queries and keys (as MMAudio's q_norm/k_norm), no rotary across
the two streams, eager einsum core. (The cross layer is a reduction of MMAudio's joint attention.)

This file: one bug: scores.softmax(dim=-2): normalised over the latent queries, not the clip keys"""

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class ClipCrossAttention(nn.Module):
    def __init__(self, dim=64, nheads=4):
        super().__init__()
        self.nheads = nheads
        self.head_dim = dim // nheads
        self.q_proj = nn.Linear(dim, dim, bias=True)
        self.kv_proj = nn.Linear(dim, 2 * dim, bias=True)
        self.q_norm = RMSNorm(self.head_dim)
        self.k_norm = RMSNorm(self.head_dim)
        self.out_proj = nn.Linear(dim, dim, bias=True)

    def forward(self, latent, clip_f):
        b, n, _ = latent.shape
        q = self.q_proj(latent).view(b, n, self.nheads, self.head_dim).transpose(1, 2)
        k, v = self.kv_proj(clip_f).chunk(2, dim=-1)
        k = k.unflatten(-1, (self.nheads, self.head_dim)).transpose(1, 2)
        v = v.unflatten(-1, (self.nheads, self.head_dim)).transpose(1, 2)
        q, k = self.q_norm(q), self.k_norm(k)
        scores = torch.einsum("bhid,bhjd->bhij", q, k) / self.head_dim ** 0.5
        weights = scores.softmax(dim=-2)
        out = torch.einsum("bhij,bhjd->bhid", weights, v)
        return self.out_proj(out.transpose(1, 2).reshape(b, n, -1))


class MMAudioCondBlock(nn.Module):
    def __init__(self, dim=64):
        super().__init__()
        self.latent_norm = nn.LayerNorm(dim)
        self.clip_norm = nn.LayerNorm(dim)
        self.cross_attn = ClipCrossAttention(dim, 4)

    def forward(self, latent, clip_f):
        return latent + self.cross_attn(self.latent_norm(latent), self.clip_norm(clip_f))


def make_mmaudio_cond_block():
    torch.manual_seed(4803)
    model = MMAudioCondBlock()
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, (RMSNorm, nn.LayerNorm)):
                mod.weight.uniform_(0.5, 1.5)
            if isinstance(mod, nn.LayerNorm):
                mod.bias.uniform_(-0.2, 0.2)
            if isinstance(mod, nn.Linear):
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {'target': 'make_mmaudio_cond_block',
 'kind': 'cross',
 'ok': False,
 'layer': 'cross_attn',
 'stage': 'weights',
 'mistake': 'softmax_wrong_dim',
 'style': 'MMAudio (hkchengrex) (b17_mmaudio_softmax_over_queries): (base c03) one bug: '
          'scores.softmax(dim=-2): normalised over the latent queries, not the clip keys'}

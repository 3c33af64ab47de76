"""AbLang2 (oxpig, TobiasHeOl/AbLang2) style antibody encoder block: pre-LayerNorm, separate biased
q/k/v/out projections, rotary embeddings from a rotary_embedding_torch-like helper (interleaved
pairs, theta 1e4, rotating the first `rot_dim` features of each head), a boolean padding mask
(True = padding) filled with -inf, bidirectional attention. Built per call in float64 and cast.
4 heads x 16, SDPA core (padding mask inverted to keep = True), rotary on the first 8 of 16 features of
each head (RotaryEmbedding(dim=8), fraction 0.5), interleaved, theta 1e4.

This file: correct."""

import math

import torch
import torch.nn.functional as F
from torch import nn


def rotate_half(x):
    x = x.unflatten(-1, (-1, 2))
    x1, x2 = x.unbind(dim=-1)
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, theta=10000.0):
        super().__init__()
        self.dim = dim
        self.theta = theta

    def forward(self, seq_len, dtype, device):
        freqs = 1.0 / (self.theta ** (torch.arange(0, self.dim, 2, dtype=torch.float64, device=device) / self.dim))
        t = torch.arange(seq_len, dtype=torch.float64, device=device)
        freqs = torch.einsum("i,j->ij", t, freqs)
        freqs = freqs.repeat_interleave(2, dim=-1)
        return freqs.to(dtype)

    def rotate_queries_or_keys(self, t, seq_dim=-2):
        freqs = self.forward(t.shape[seq_dim], t.dtype, t.device)
        if seq_dim == -3:
            freqs = freqs[:, None, :]
        rot_dim = freqs.shape[-1]
        t_rot, t_pass = t[..., :rot_dim], t[..., rot_dim:]
        t_rot = (t_rot * freqs.cos()) + (rotate_half(t_rot) * freqs.sin())
        return torch.cat((t_rot, t_pass), dim=-1)


class MultiHeadAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, rotary_dim=None, bias=True, use_sdpa=False):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim**-0.5
        self.use_sdpa = use_sdpa
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.rotary_emb = RotaryEmbedding(dim=rotary_dim or self.head_dim)

    def attention(self, q, k, v, attn_mask=None):
        if self.use_sdpa:
            keep = None if attn_mask is None else ~attn_mask[:, None, None, :]
            return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=self.scaling)
        attn_weights = torch.matmul(q, k.transpose(-2, -1))
        attn_weights = attn_weights / math.sqrt(self.head_dim)
        if attn_mask is not None:
            attn_weights = attn_weights.masked_fill(attn_mask[:, None, None, :], float("-inf"))
        attn_weights = F.softmax(attn_weights, dim=-1)
        return torch.matmul(attn_weights, v)

    def forward(self, x, attn_mask=None):
        batch_size, seq_len, embed_dim = x.size()
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.contiguous().view(batch_size, seq_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.contiguous().view(batch_size, seq_len, self.num_heads, self.head_dim).transpose(1, 2)
        v = v.contiguous().view(batch_size, seq_len, self.num_heads, self.head_dim).transpose(1, 2)
        q = self.rotary_emb.rotate_queries_or_keys(q)
        k = self.rotary_emb.rotate_queries_or_keys(k)
        attn = self.attention(q, k, v, attn_mask=attn_mask)
        attn = attn.transpose(1, 2).reshape(batch_size, seq_len, embed_dim)
        return self.out_proj(attn)


class TransformerEncoder(nn.Module):
    def __init__(self, hidden_embed_size, n_attn_heads, rotary_dim=None, use_sdpa=False):
        super().__init__()
        self.multihead_attention = MultiHeadAttention(hidden_embed_size, n_attn_heads, rotary_dim, use_sdpa=use_sdpa)
        self.intermediate_layer = nn.Sequential(
            nn.Linear(hidden_embed_size, hidden_embed_size * 4),
            nn.GELU(),
            nn.Linear(hidden_embed_size * 4, hidden_embed_size),
        )
        self.pre_attn_layer_norm = nn.LayerNorm(hidden_embed_size, eps=1e-12)
        self.final_layer_norm = nn.LayerNorm(hidden_embed_size, eps=1e-12)

    def forward(self, hidden_embed, attn_mask=None):
        hidden_embed = hidden_embed + self.multihead_attention(self.pre_attn_layer_norm(hidden_embed), attn_mask)
        return hidden_embed + self.intermediate_layer(self.final_layer_norm(hidden_embed))


class AbRep(nn.Module):
    def __init__(self, hidden_embed_size=64, n_attn_heads=4, rotary_dim=8, use_sdpa=True):
        super().__init__()
        self.encoder_blocks = nn.ModuleList([TransformerEncoder(hidden_embed_size, n_attn_heads, rotary_dim, use_sdpa)])
        self.layer_norm_after_encoder_blocks = nn.LayerNorm(hidden_embed_size)

    def forward(self, embeddings):
        # no padding in a batch of equal-length embeddings: the padding mask is all False
        attn_mask = torch.zeros(embeddings.shape[:2], dtype=torch.bool, device=embeddings.device)
        h = embeddings
        for block in self.encoder_blocks:
            h = block(h, attn_mask=attn_mask)
        return self.layer_norm_after_encoder_blocks(h)


def make_ablang2():
    torch.manual_seed(5010)
    model = AbRep()
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
            if isinstance(mod, nn.Linear) and mod.bias is not None:
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {'target': 'make_ablang2',
 'kind': 'multihead',
 'ok': True,
 'layer': 'encoder_blocks.0.multihead_attention',
 'structure': {'heads': 4,
               'kv_heads': 4,
               'head_dim': 16,
               'causal': False,
               'cross': False,
               'rope': {'pairing': 'interleaved', 'fraction': 0.5, 'base': 10000},
               'qk_norm': None,
               'window': None,
               'bias': None},
 'style': 'AbLang2 (oxpig) (c10): correct: partial interleaved rotary (8 of 16 features), SDPA '
          'with the inverted padding mask'}

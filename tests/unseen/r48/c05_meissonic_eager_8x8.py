"""Meissonic (viiika / MeissonFlow) single-stream transformer attention, in the diffusers
Attention + FluxAttnProcessor2_0 style Meissonic builds on: biased to_q/to_k/to_v, RMSNorm QK norm
(norm_q/norm_k), rotary from get_1d_rotary_pos_embed(use_real=True, repeat_interleave_real=True)
applied with apply_rotary_emb's adjacent-pair rotation, bidirectional, to_out = [Linear, Dropout].
Token positions are the flattened VQ-token index (one row).

This file: correct: 8x8 heads, per-head QK norm, eager matmul/softmax core"""

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return hidden_states * torch.rsqrt(variance + self.eps) * self.weight


def get_1d_rotary_pos_embed(dim, pos, theta, dtype):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=pos.device) / dim))
    freqs = torch.outer(pos.to(torch.float64), freqs)
    cos = freqs.cos().repeat_interleave(2, dim=1)
    sin = freqs.sin().repeat_interleave(2, dim=1)
    return cos.to(dtype), sin.to(dtype)


def apply_rotary_emb(x, freqs_cis):
    cos, sin = freqs_cis
    cos, sin = cos[None, None], sin[None, None]
    x_real, x_imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    x_rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(3)
    return x * cos + x_rotated * sin


class Attention(nn.Module):
    def __init__(self, query_dim=64, heads=8, dim_head=8, qk_norm_across_heads=False, use_sdpa=False):
        super().__init__()
        self.heads = heads
        self.inner_dim = heads * dim_head
        self.scale = dim_head ** -0.5
        self.use_sdpa = use_sdpa
        self.to_q = nn.Linear(query_dim, self.inner_dim, bias=True)
        self.to_k = nn.Linear(query_dim, self.inner_dim, bias=True)
        self.to_v = nn.Linear(query_dim, self.inner_dim, bias=True)
        norm_dim = self.inner_dim if qk_norm_across_heads else dim_head
        self.qk_norm_across_heads = qk_norm_across_heads
        self.norm_q = RMSNorm(norm_dim)
        self.norm_k = RMSNorm(norm_dim)
        self.to_out = nn.ModuleList([nn.Linear(self.inner_dim, query_dim, bias=True), nn.Dropout(0.0)])

    def forward(self, hidden_states, image_rotary_emb=None):
        batch_size, seq_len, _ = hidden_states.shape
        query = self.to_q(hidden_states)
        key = self.to_k(hidden_states)
        value = self.to_v(hidden_states)
        head_dim = self.inner_dim // self.heads
        if self.qk_norm_across_heads:
            query = self.norm_q(query)
            key = self.norm_k(key)
        query = query.view(batch_size, -1, self.heads, head_dim).transpose(1, 2)
        key = key.view(batch_size, -1, self.heads, head_dim).transpose(1, 2)
        value = value.view(batch_size, -1, self.heads, head_dim).transpose(1, 2)
        if not self.qk_norm_across_heads:
            query = self.norm_q(query)
            key = self.norm_k(key)
        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb)
            key = apply_rotary_emb(key, image_rotary_emb)
        if self.use_sdpa:
            hidden_states = F.scaled_dot_product_attention(
                query, key, value, dropout_p=0.0, is_causal=False, scale=self.scale
            )
        else:
            attn = torch.matmul(query, key.transpose(-1, -2)) * self.scale
            attn = attn.softmax(dim=-1)
            hidden_states = torch.matmul(attn, value)
        hidden_states = hidden_states.transpose(1, 2).reshape(batch_size, -1, self.heads * head_dim)
        hidden_states = self.to_out[0](hidden_states)
        return self.to_out[1](hidden_states)


class SingleTransformerBlock(nn.Module):
    def __init__(self, dim=64):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = Attention(dim)
        self.proj_mlp = nn.Linear(dim, 2 * dim)
        self.act_mlp = nn.GELU(approximate="tanh")
        self.proj_out = nn.Linear(dim * 3, dim)

    def forward(self, hidden_states, image_rotary_emb):
        residual = hidden_states
        norm_hidden_states = self.norm(hidden_states)
        mlp_hidden_states = self.act_mlp(self.proj_mlp(norm_hidden_states))
        attn_output = self.attn(norm_hidden_states, image_rotary_emb=image_rotary_emb)
        hidden_states = torch.cat([attn_output, mlp_hidden_states], dim=2)
        return residual + self.proj_out(hidden_states)


class MeissonicTransformer(nn.Module):
    def __init__(self, dim=64, theta=10000.0):
        super().__init__()
        self.theta = theta
        self.single_transformer_blocks = nn.ModuleList([SingleTransformerBlock(dim)])
        self.norm_out = nn.LayerNorm(dim)

    def forward(self, hidden_states):
        attn = self.single_transformer_blocks[0].attn
        head_dim = attn.inner_dim // attn.heads
        seq_len = hidden_states.shape[1]
        ids = torch.arange(seq_len, device=hidden_states.device)
        image_rotary_emb = get_1d_rotary_pos_embed(head_dim, ids, self.theta, hidden_states.dtype)
        for block in self.single_transformer_blocks:
            hidden_states = block(hidden_states, image_rotary_emb)
        return self.norm_out(hidden_states)


def make_meissonic_transformer():
    torch.manual_seed(4805)
    model = MeissonicTransformer()
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, (RMSNorm, nn.LayerNorm)):
                mod.weight.uniform_(0.5, 1.5)
            if isinstance(mod, nn.LayerNorm):
                mod.bias.uniform_(-0.2, 0.2)
            if isinstance(mod, nn.Linear):
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {'target': 'make_meissonic_transformer',
 'kind': 'multihead',
 'ok': True,
 'layer': 'single_transformer_blocks.0.attn',
 'structure': {'heads': 8,
               'kv_heads': 8,
               'head_dim': 8,
               'causal': False,
               'cross': False,
               'rope': {'pairing': 'interleaved', 'fraction': 1.0, 'base': 10000.0},
               'qk_norm': 'per-head',
               'window': None,
               'bias': None},
 'style': 'Meissonic (viiika/MeissonFlow) (c05): correct: 8x8 heads, per-head QK norm, eager '
          'matmul/softmax core'}

"""MiniMind (jingyaogong/minimind) `Attention`: a small Chinese-community LLM trainer's Llama-style layer.

Separate q/k/v/o Linears without bias, (bsz, seq_len, heads, head_dim) views, `precompute_freqs_cis`
tables held by the model as `freqs_cos`/`freqs_sin` buffers (rotate_half halves, rope_theta 1e6) and
passed in as `position_embeddings` sliced to the sequence, `repeat_kv` by expand/reshape on the
(bsz, seq, kv_heads, head_dim) layout, and the non-flash path: `(xq @ xk^T) / sqrt(head_dim)` plus a
`triu(full(-inf), 1)` mask, a float softmax, `@ xv`, transpose/reshape and `o_proj`.

This file: one bug: only the queries are rotated; the rotated keys are discarded."""

import math

import torch
import torch.nn.functional as F
from torch import nn


class MiniMindConfig:
    hidden_size = 64
    num_attention_heads = 8
    num_key_value_heads = 2
    max_position_embeddings = 128
    rope_theta = 1000000.0
    rms_norm_eps = 1e-5


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def precompute_freqs_cis(dim, end, rope_base):
    freqs = 1.0 / (rope_base ** (torch.arange(0, dim, 2, dtype=torch.float64)[: dim // 2] / dim))
    t = torch.arange(end, dtype=torch.float64)
    freqs = torch.outer(t, freqs)
    freqs_cos = torch.cat([torch.cos(freqs), torch.cos(freqs)], dim=-1)
    freqs_sin = torch.cat([torch.sin(freqs), torch.sin(freqs)], dim=-1)
    return freqs_cos, freqs_sin


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    def rotate_half(x):
        return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)

    q_embed = (q * cos.unsqueeze(unsqueeze_dim)) + (rotate_half(q) * sin.unsqueeze(unsqueeze_dim))
    k_embed = (k * cos.unsqueeze(unsqueeze_dim)) + (rotate_half(k) * sin.unsqueeze(unsqueeze_dim))
    return q_embed, k_embed


def repeat_kv(x, n_rep):
    bs, slen, num_key_value_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return (
        x[:, :, :, None, :]
        .expand(bs, slen, num_key_value_heads, n_rep, head_dim)
        .reshape(bs, slen, num_key_value_heads * n_rep, head_dim)
    )


class Attention(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.num_key_value_heads = args.num_key_value_heads
        self.n_local_heads = args.num_attention_heads
        self.n_local_kv_heads = self.num_key_value_heads
        self.n_rep = self.n_local_heads // self.n_local_kv_heads
        self.head_dim = args.hidden_size // args.num_attention_heads
        self.q_proj = nn.Linear(args.hidden_size, args.num_attention_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(args.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(args.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(args.num_attention_heads * self.head_dim, args.hidden_size, bias=False)
        self.flash = False  # the manual path below, as on machines without SDPA

    def forward(self, x, position_embeddings, attention_mask=None):
        bsz, seq_len, _ = x.shape
        xq, xk, xv = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        xq = xq.view(bsz, seq_len, self.n_local_heads, self.head_dim)
        xk = xk.view(bsz, seq_len, self.n_local_kv_heads, self.head_dim)
        xv = xv.view(bsz, seq_len, self.n_local_kv_heads, self.head_dim)

        cos, sin = position_embeddings
        xq, _ = apply_rotary_pos_emb(xq, xk, cos[:seq_len], sin[:seq_len])

        xq, xk, xv = (
            xq.transpose(1, 2),
            repeat_kv(xk, self.n_rep).transpose(1, 2),
            repeat_kv(xv, self.n_rep).transpose(1, 2),
        )
        scores = (xq @ xk.transpose(-2, -1)) / math.sqrt(self.head_dim)
        scores = scores + torch.triu(
            torch.full((seq_len, seq_len), float("-inf"), device=scores.device), diagonal=1
        ).unsqueeze(0).unsqueeze(0)
        scores = F.softmax(scores.float() if scores.dtype == torch.float16 else scores, dim=-1).type_as(xq)
        output = scores @ xv
        output = output.transpose(1, 2).reshape(bsz, seq_len, -1)
        return self.o_proj(output)


class MiniMindBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = Attention(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings):
        return hidden_states + self.self_attn(self.input_layernorm(hidden_states), position_embeddings)


class MiniMindModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList([MiniMindBlock(config)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        freqs_cos, freqs_sin = precompute_freqs_cis(
            dim=config.hidden_size // config.num_attention_heads,
            end=config.max_position_embeddings,
            rope_base=config.rope_theta,
        )
        self.register_buffer("freqs_cos", freqs_cos, persistent=False)
        self.register_buffer("freqs_sin", freqs_sin, persistent=False)

    def forward(self, hidden_states, start_pos=0):
        seq_length = hidden_states.shape[1]
        position_embeddings = (
            self.freqs_cos[start_pos:start_pos + seq_length].to(hidden_states.dtype),
            self.freqs_sin[start_pos:start_pos + seq_length].to(hidden_states.dtype),
        )
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_embeddings)
        return self.norm(hidden_states)


def make_minimind():
    torch.manual_seed(1825)
    model = MiniMindModel(MiniMindConfig())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {'target': 'make_minimind',
 'kind': 'causal-multihead',
 'layer': 'layers.0.self_attn',
 'ok': False,
 'stage': 'rotated_keys',
 'mistake': 'rope_missing',
 'style': 'MiniMind Attention: xq, _ = apply_rotary_pos_emb(xq, xk, ...), the rotated keys thrown '
          'away'}

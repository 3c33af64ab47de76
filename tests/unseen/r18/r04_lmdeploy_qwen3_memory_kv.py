"""lmdeploy PyTorch engine (InternLM/lmdeploy `pytorch/models`) Qwen3Attention, in plain torch.

The engine works on a flattened token batch: the model flattens (batch, tokens) into one axis, builds
per-token `position_ids` and one (cos, sin) row per token with its `rotary_emb`, and hands the layer
`attn_metadata` with `q_seqlens`/`q_start_loc`. The layer runs a fused `qkv_proj` (`split_qkv`),
per-head `q_norm`/`k_norm` RMSNorm on the split heads, `apply_rotary_pos_emb` on (tokens, heads, head_dim) and `attn_fwd`, here a plain-torch
stand-in for the paged-attention kernel that loops over the sequences of the batch (GQA by
`repeat_interleave`, softmax scale head_dim**-0.5, causal by key position <= query position).

This file: refused (learned persistent memory key/value slots, 4 per kv head, always visible, concatenated before the sequence's keys)."""

import math

import torch
from torch import nn


class ModelConfig:
    hidden_size = 64
    num_attention_heads = 4
    num_key_value_heads = 2
    head_dim = 16
    rope_theta = 1000000.0
    partial_rotary_factor = 1.0
    qkv_bias = False
    use_qk_norm = True
    rms_norm_eps = 1e-6


class RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x):
        v = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(v + self.eps))


class RotaryEmbedding(nn.Module):
    def __init__(self, rotary_dim, base):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x, position_ids):
        freqs = position_ids.to(torch.float64)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_every_two(x):
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


class ApplyRotaryEmb:
    """(tokens, heads, dim) tensors; cos/sin are (tokens, rotary_dim). Only the first rotary_dim
    features of each head are rotated; the rest pass through."""

    def __init__(self, rotate):
        self.rotate = rotate

    def __call__(self, q, k, cos, sin):
        rd = cos.shape[-1]
        cos, sin = cos[:, None, :], sin[:, None, :]

        def one(x):
            x_rot, x_pass = x[..., :rd], x[..., rd:]
            return torch.cat((x_rot * cos + self.rotate(x_rot) * sin, x_pass), dim=-1)

        return one(q), one(k)


def paged_attention_fwd(q, k, v, attn_metadata, scale, mem_k, mem_v):
    """Stand-in for lmdeploy's paged attention kernel: q (tokens, heads, d), k/v (tokens, kv_heads, d)."""
    outs = []
    n_rep = q.shape[1] // k.shape[1]
    for start, length in zip(attn_metadata["q_start_loc"], attn_metadata["q_seqlens"]):
        qs = q[start:start + length].transpose(0, 1)
        ks = k[start:start + length].repeat_interleave(n_rep, dim=1).transpose(0, 1)
        vs = v[start:start + length].repeat_interleave(n_rep, dim=1).transpose(0, 1)
        mk = mem_k.repeat_interleave(n_rep, dim=0).to(qs.dtype)
        mv = mem_v.repeat_interleave(n_rep, dim=0).to(qs.dtype)
        ks, vs = torch.cat((mk, ks), dim=1), torch.cat((mv, vs), dim=1)
        s = torch.matmul(qs, ks.transpose(-1, -2)) * scale
        pos = torch.arange(length, device=q.device)
        visible = pos[None, :] <= pos[:, None]
        visible = torch.cat((torch.ones(length, mk.shape[1], dtype=torch.bool, device=q.device), visible), dim=1)
        s = s.masked_fill(~visible, torch.finfo(s.dtype).min)
        p = torch.softmax(s, dim=-1)
        outs.append(torch.matmul(p, vs).transpose(0, 1))
    return torch.cat(outs, dim=0)


class Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        out = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, out, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        if config.use_qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.apply_rotary_pos_emb = ApplyRotaryEmb(rotate_half)
        self.scale = self.head_dim ** -0.5
        self.mem_k = nn.Parameter(torch.randn(self.num_kv_heads, 4, self.head_dim))
        self.mem_v = nn.Parameter(torch.randn(self.num_kv_heads, 4, self.head_dim))

    def split_qkv(self, qkv):
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        return (
            q.unflatten(-1, (self.num_heads, self.head_dim)),
            k.unflatten(-1, (self.num_kv_heads, self.head_dim)),
            v.unflatten(-1, (self.num_kv_heads, self.head_dim)),
        )

    def forward(self, hidden_states, rotary_pos_emb, attn_metadata):
        query_states, key_states, value_states = self.split_qkv(self.qkv_proj(hidden_states))
        cos, sin = rotary_pos_emb
        query_states = self.q_norm(query_states)
        key_states = self.k_norm(key_states)
        query_states, key_states = self.apply_rotary_pos_emb(query_states, key_states, cos, sin)
        attn_output = paged_attention_fwd(query_states, key_states, value_states, attn_metadata, self.scale, self.mem_k, self.mem_v)
        attn_output = attn_output.reshape(*hidden_states.shape[:-1], -1)
        return self.o_proj(attn_output)


class DecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)

    def forward(self, hidden_states, rotary_pos_emb, attn_metadata):
        return hidden_states + self.self_attn(self.input_layernorm(hidden_states), rotary_pos_emb, attn_metadata)


class CausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        rotary_dim = int(config.head_dim * config.partial_rotary_factor)
        self.rotary_emb = RotaryEmbedding(rotary_dim, config.rope_theta)
        self.layers = nn.ModuleList([DecoderLayer(config)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, inputs_embeds):
        bsz, seqlen, dim = inputs_embeds.shape
        hidden_states = inputs_embeds.reshape(bsz * seqlen, dim)  # flattened token batch
        position_ids = torch.arange(seqlen, device=inputs_embeds.device).repeat(bsz)
        attn_metadata = {"q_seqlens": [seqlen] * bsz, "q_start_loc": [i * seqlen for i in range(bsz)]}
        rotary_pos_emb = self.rotary_emb(hidden_states, position_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states, rotary_pos_emb, attn_metadata)
        return self.norm(hidden_states).reshape(bsz, seqlen, dim)


def make_lmdeploy_memory_kv():
    torch.manual_seed(1837)
    model = CausalLM(ModelConfig())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.uniform_(0.5, 1.5)
        if model.layers[0].self_attn.qkv_proj.bias is not None:
            model.layers[0].self_attn.qkv_proj.bias.uniform_(-0.3, 0.3)
    return model.eval()


EXPECT = {'target': 'make_lmdeploy_memory_kv',
 'kind': 'causal-multihead',
 'layer': 'layers.0.self_attn',
 'ok': True,
 'unsupported': 'memory_kv',
 'style': 'lmdeploy Qwen3Attention with learned persistent memory key/value slots (all-attention '
          'style) prepended to every sequence'}

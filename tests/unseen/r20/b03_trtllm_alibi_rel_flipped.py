"""TensorRT-LLM PyTorch-flow style (tensorrt_llm/_torch): the decoder runs on a packed token axis
[num_tokens, hidden] with an AttnMetadata holding per-request seq_lens; Attention has one fused qkv_proj
split into q/k/v, a RotaryEmbedding(is_neox) applied to (position_ids, [q, k]) and a VanillaAttention
backend that walks the requests and does the grouped attention in plain torch. ALiBi layers get
generate_alibi_slopes / a relative alibi bias instead of the rotary.

This file: one bug: relative distance taken as query - key, so slope * distance rewards far keys"""

import math

import torch
from torch import nn


class ModelConfig:
    hidden_size = 64
    num_attention_heads = 4
    num_key_value_heads = 4
    head_dim = 16
    rope_theta = 10000.0
    position_embedding_type = "alibi"
    rms_norm_eps = 1e-5


class RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        var = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(var + self.variance_epsilon))


class AttnMetadata:
    def __init__(self, seq_lens):
        self.seq_lens = list(seq_lens)
        self.num_contexts = len(self.seq_lens)


def generate_alibi_slopes(num_heads):
    closest = 2 ** math.floor(math.log2(num_heads))
    base = 2.0 ** (-(2.0 ** -(math.log2(closest) - 3)))
    slopes = [base ** (i + 1) for i in range(closest)]
    if closest != num_heads:
        extra = 2.0 ** (-(2.0 ** -(math.log2(2 * closest) - 3)))
        slopes += [extra ** (2 * i + 1) for i in range(num_heads - closest)]
    return torch.tensor(slopes, dtype=torch.float64)


class RotaryEmbedding(nn.Module):
    """cos/sin cache [max_positions, 2, rot_dim // 2]; neox = rotate the two halves of each head."""

    def __init__(self, base, head_dim, max_positions=256, is_neox=True):
        super().__init__()
        self.head_dim = head_dim
        self.is_neox = is_neox
        inv = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        t = torch.arange(max_positions, dtype=torch.float64)
        freqs = torch.outer(t, inv)
        self.register_buffer("rotary_cos_sin", torch.stack([freqs.cos(), freqs.sin()], 1), persistent=False)

    def _rotate(self, x, cos, sin):
        x = x.unflatten(-1, (-1, self.head_dim))
        cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        return out.flatten(-2)

    def forward(self, position_ids, targets):
        cs = self.rotary_cos_sin[position_ids]
        cos, sin = cs[:, 0], cs[:, 1]
        return [self._rotate(t, cos, sin) for t in targets]


class VanillaAttention(nn.Module):
    def __init__(self, num_heads, head_dim, num_kv_heads, alibi_slopes=None):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = 1.0 / math.sqrt(head_dim)
        if alibi_slopes is not None:
            self.register_buffer("alibi_slopes", alibi_slopes, persistent=False)
        else:
            self.alibi_slopes = None

    def _one(self, q, k, v, use_alibi):
        n = q.shape[0]
        q = q.view(n, self.num_heads, self.head_dim).transpose(0, 1)
        k = k.view(n, self.num_kv_heads, self.head_dim).transpose(0, 1)
        v = v.view(n, self.num_kv_heads, self.head_dim).transpose(0, 1)
        rep = self.num_heads // self.num_kv_heads
        if rep > 1:
            k = k.repeat_interleave(rep, dim=0)
            v = v.repeat_interleave(rep, dim=0)
        s = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        if use_alibi:
            pos = torch.arange(n, device=q.device)
            rel = (pos[:, None] - pos[None, :]).to(s.dtype)
            s = s + self.alibi_slopes.to(s.dtype)[:, None, None] * rel
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        s = s.masked_fill(causal, float("-inf"))
        p = torch.softmax(s, dim=-1)
        return torch.matmul(p, v).transpose(0, 1).reshape(n, -1)

    def forward(self, q, k, v, attn_metadata):
        outs, start = [], 0
        for n in attn_metadata.seq_lens:
            sl = slice(start, start + n)
            outs.append(self._one(q[sl], k[sl], v[sl], self.alibi_slopes is not None))
            start += n
        return torch.cat(outs, 0)


class Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_key_value_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        if config.position_embedding_type == "rope_gpt_neox":
            self.rotary_emb = RotaryEmbedding(config.rope_theta, self.head_dim, is_neox=True)
            slopes = None
        else:
            self.rotary_emb = None
            slopes = generate_alibi_slopes(self.num_heads)
        self.attn = VanillaAttention(self.num_heads, self.head_dim, self.num_key_value_heads, slopes)

    def forward(self, position_ids, hidden_states, attn_metadata):
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(position_ids, [q, k])
        out = self.attn(q, k, v, attn_metadata)
        return self.o_proj(out)


class DecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)

    def forward(self, position_ids, hidden_states, attn_metadata):
        h = self.self_attn(position_ids, self.input_layernorm(hidden_states), attn_metadata)
        return hidden_states + h


class PackedModel(nn.Module):
    """Takes (batch, tokens, hidden), packs it the way the runtime does, unpacks the result."""

    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList([DecoderLayer(config)])

    def forward(self, inputs_embeds):
        b, t, d = inputs_embeds.shape
        meta = AttnMetadata([t] * b)
        position_ids = torch.cat([torch.arange(n) for n in meta.seq_lens]).to(inputs_embeds.device)
        h = inputs_embeds.reshape(b * t, d)
        for layer in self.layers:
            h = layer(position_ids, h, meta)
        return h.view(b, t, d)


def make_trtllm_alibi():
    torch.manual_seed(2005)
    model = PackedModel(ModelConfig())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.uniform_(0.6, 1.4)
    return model.eval()


EXPECT = {'target': 'make_trtllm_alibi',
 'kind': 'causal-multihead',
 'ok': False,
 'layer': 'layers.0.self_attn',
 'stage': 'biased_scores',
 'mistake': 'bias_sign',
 'style': 'TensorRT-LLM _torch packed-token Attention + VanillaAttention: one bug: relative '
          'distance taken as query - key, so slope * distance rewards far keys'}

"""mit-han-lab/omniserve (QServe) Llama prefill path (omniserve/modeling/models/llama_w4a8_unpad.py and
its attention), with the fused kernels written out in torch.

QServe runs prefill "unpadded": the batch is flattened to (num_tokens, hidden) and an `input_metadata`
object carries `cu_seqlens` (cumulative sequence starts) and per-token `positions`.  Kept: `model`
(`embed_tokens`, `layers.N`, `norm`), `lm_head`; LlamaDecoderLayer with `input_layernorm`,
`self_attn`, `post_attention_layernorm`, `mlp` (`gate_up_proj` fused, `down_proj`); LlamaAttention with
one fused `qkv_proj` (q | k | v rows), `o_proj`, GQA 8 query heads over 2 kv heads (head_dim 8), the
neox-style (rotate-half) rotary at the per-token positions, theta 1e4, and a varlen attention that walks
`cu_seqlens`: each sequence's tokens attend causally to that sequence's keys only (1/sqrt(d), -inf
fill, softmax, kv head h // 4 for query head h).
Slip: layer 1 was switched to the decode-era dense fallback, which builds its causal mask over the
whole flattened token list and ignores `cu_seqlens`: from batch 2 on, the tokens of a sequence also
attend to the earlier sequences' tokens.  Rotary positions stay per sequence.  Other layers exact.
No cache.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["model.layers.0.self_attn", "model.layers.1.self_attn", "model.layers.2.self_attn"],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "model.layers.1.self_attn",
    "stage": "scores",
    "mistake": "batch_mixing",
    "style": "omniserve/QServe llama unpadded prefill: fused qkv_proj + gate_up_proj, GQA 8/2 head 8, neox rotary "
    "at input_metadata.positions, varlen attention over cu_seqlens; layer 1's dense fallback masks the flattened "
    "token list as one sequence",
}


class RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def neox_rotary(x, positions, base):
    # x: (tokens, heads, d)
    d = x.shape[-1]
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    freqs = positions.to(torch.float64)[:, None] * inv_freq[None]
    cos = freqs.cos().to(x.dtype)[:, None, :]
    sin = freqs.sin().to(x.dtype)[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _attend(q, k, v, mask, scale, groups):
    # q: (n, h, d); k, v: (n, kv, d); mask: (n, n) bool keep
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    scores = scores.masked_fill(~mask[None], float("-inf"))
    probs = F.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def varlen_attention(q, k, v, cu_seqlens, scale, groups):
    outs = []
    for i in range(len(cu_seqlens) - 1):
        s, e = int(cu_seqlens[i]), int(cu_seqlens[i + 1])
        n = e - s
        mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        outs.append(_attend(q[s:e], k[s:e], v[s:e], mask, scale, groups))
    return torch.cat(outs, dim=0)


def dense_fallback_attention(q, k, v, scale, groups):
    n = q.shape[0]
    mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    return _attend(q, k, v, mask, scale, groups)


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scaling = self.head_dim ** -0.5
        self.rope_theta = config.rope_theta
        self.use_dense_fallback = layer_idx in config.dense_fallback_layers
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)

    def forward(self, hidden_states, input_metadata):
        # hidden_states: (num_tokens, hidden)
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        n = hidden_states.shape[0]
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        q = neox_rotary(q, input_metadata.positions, self.rope_theta)
        k = neox_rotary(k, input_metadata.positions, self.rope_theta)
        groups = self.num_heads // self.num_kv_heads
        if self.use_dense_fallback:
            out = dense_fallback_attention(q, k, v, self.scaling, groups)
        else:
            out = varlen_attention(q, k, v, input_metadata.cu_seqlens, self.scaling, groups)
        return self.o_proj(out.reshape(n, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states, input_metadata):
        h = hidden_states + self.self_attn(self.input_layernorm(hidden_states), input_metadata)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids):
        b, s = input_ids.shape
        flat_ids = input_ids.reshape(-1)
        input_metadata = SimpleNamespace(
            cu_seqlens=torch.arange(0, (b + 1) * s, s, device=input_ids.device),
            positions=torch.arange(s, device=input_ids.device).repeat(b),
        )
        h = self.model.embed_tokens(flat_ids)
        for layer in self.model.layers:
            h = layer(h, input_metadata)
        return self.lm_head(self.model.norm(h)).view(b, s, -1)



def make_model():
    torch.manual_seed(2208)
    config = SimpleNamespace(
        vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
        num_attention_heads=8, num_key_value_heads=2, rope_theta=10000.0, rms_norm_eps=1e-5,
        dense_fallback_layers=(1,),
    )
    model = LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(22081)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

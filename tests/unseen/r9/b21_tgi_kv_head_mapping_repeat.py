"""TGI FlashLlamaAttention (flat tokens, cu_seqlens, GQA 8:2) whose kv_head_mapping is
arange(kv_heads).repeat(num_groups) = [0, 1, 0, 1, ...] instead of repeat_interleave
= [0, 0, 0, 0, 1, 1, 1, 1]: query head h reads kv head h % 2 instead of h // 4.
"""

import torch
import torch.nn.functional as F
from torch import nn


class PositionRotaryEmbedding(nn.Module):
    def __init__(self, dim, base=10000.0):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def get_cos_sin(self, position_ids, max_s, dtype):
        t = torch.arange(max_s, dtype=self.inv_freq.dtype)
        freqs = torch.outer(t, self.inv_freq)
        cos = torch.index_select(torch.cos(freqs), 0, position_ids)
        sin = torch.index_select(torch.sin(freqs), 0, position_ids)
        return cos.unsqueeze(1).to(dtype), sin.unsqueeze(1).to(dtype)

    def forward(self, query, key, cos, sin):
        rotary_dim = cos.shape[-1]
        for x in (query, key):
            x1 = x[..., :rotary_dim]
            x2 = x[..., rotary_dim : 2 * rotary_dim]
            o1 = x1 * cos - x2 * sin
            o2 = x2 * cos + x1 * sin
            x[..., :rotary_dim] = o1
            x[..., rotary_dim : 2 * rotary_dim] = o2


def varlen_attention(query, key, value, cu_seqlens, softmax_scale, kv_head_mapping):
    out = torch.empty_like(query)
    for i in range(cu_seqlens.numel() - 1):
        s, e = int(cu_seqlens[i]), int(cu_seqlens[i + 1])
        q = query[s:e].transpose(0, 1)  # (heads, len, d)
        k = key[s:e][:, kv_head_mapping].transpose(0, 1)
        v = value[s:e][:, kv_head_mapping].transpose(0, 1)
        o = F.scaled_dot_product_attention(
            q[None], k[None], v[None], is_causal=True, scale=softmax_scale
        )[0]
        out[s:e] = o.transpose(0, 1)
    return out


class FlashLlamaAttention(nn.Module):
    def __init__(self, hidden_size=64, num_heads=8, num_key_value_heads=2, rope_theta=10000.0):
        super().__init__()
        self.num_heads = num_heads
        self.hidden_size = hidden_size
        self.head_size = hidden_size // num_heads
        self.num_key_value_heads = num_key_value_heads
        self.rotary_emb = PositionRotaryEmbedding(self.head_size, base=rope_theta)
        self.softmax_scale = self.head_size**-0.5
        self.query_key_value = nn.Linear(
            hidden_size, (num_heads + 2 * num_key_value_heads) * self.head_size, bias=False
        )
        self.o_proj = nn.Linear(num_heads * self.head_size, hidden_size, bias=False)
        self.num_groups = self.num_heads // self.num_key_value_heads
        self.register_buffer(
            "kv_head_mapping",
            torch.arange(0, self.num_key_value_heads, dtype=torch.int32).repeat(self.num_groups),
            persistent=False,
        )

    def forward(self, hidden_states, cos, sin, cu_seqlen_prefill, max_s):
        qkv = self.query_key_value(hidden_states)
        query, kv = qkv.split(
            [self.head_size * self.num_heads, 2 * self.head_size * self.num_key_value_heads], dim=1
        )
        query = query.view(-1, self.num_heads, self.head_size).clone()
        kv = kv.view(-1, 2, self.num_key_value_heads, self.head_size).clone()

        self.rotary_emb(query, torch.select(kv, dim=1, index=0), cos, sin)

        attn_output = varlen_attention(
            query,
            kv[:, 0],
            kv[:, 1],
            cu_seqlen_prefill,
            self.softmax_scale,
            self.kv_head_mapping.long(),
        )
        return self.o_proj(attn_output.view(-1, self.num_heads * self.head_size))


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class FlashLlamaLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = FlashLlamaAttention()
        self.input_layernorm = LlamaRMSNorm(64)

    def forward(self, hidden_states, cos, sin, cu_seqlen_prefill, max_s):
        normed = self.input_layernorm(hidden_states)
        return hidden_states + self.self_attn(normed, cos, sin, cu_seqlen_prefill, max_s)


class PaddedBatchRunner(nn.Module):
    """Feeds a padded (batch, tokens, d) batch through the flat-token layer."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([FlashLlamaLayer()])

    def forward(self, x):
        b, n, d = x.shape
        flat = x.reshape(b * n, d)
        position_ids = torch.arange(n).repeat(b)
        cu_seqlens = torch.arange(0, (b + 1) * n, n, dtype=torch.int32)
        cos, sin = self.layers[0].self_attn.rotary_emb.get_cos_sin(position_ids, n, x.dtype)
        for layer in self.layers:
            flat = layer(flat, cos, sin, cu_seqlens, n)
        return flat.view(b, n, d)


def make_tgi_runner():
    torch.manual_seed(114)
    runner = PaddedBatchRunner()
    with torch.no_grad():
        runner.layers[0].input_layernorm.weight.uniform_(0.5, 1.5)
    return runner.eval()


EXPECT = {
    "target": "make_tgi_runner",
    "kind": "causal-multihead",
    "ok": False,
    "layer": "layers.0.self_attn",
    "stage": "scores",
    "mistake": "kv_group_mapping",
    "style": "TGI FlashLlamaAttention on flattened tokens (fused query_key_value, NeoX rotary, varlen fallback): kv_head_mapping built with .repeat instead of .repeat_interleave",
}

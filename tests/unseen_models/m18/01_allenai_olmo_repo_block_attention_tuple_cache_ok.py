"""AllenAI OLMo training repository (olmo/model.py), not the transformers port.

OLMo: `transformer` is an nn.ModuleDict(wte, blocks, ln_f); every block is an OLMoSequentialBlock that
holds its own fused `att_proj` (no bias, fused_dims = (d_model, kv * hd, kv * hd)), `attn_out`,
`ff_proj` / `ff_out` (SwiGLU: the second half of ff_proj is the gate), `attn_norm` / `ff_norm` (RMS
layer norms with a weight) and a `rotary_emb`.  The attention is computed by the block's own
`attention()` method, so the attention layer is the block `transformer.blocks.N`.
GQA 4/2 (head 16) via repeat_interleave before SDPA; rotate_half rotary, base 1e4.  The cache holds
keys *before* the rotary: on every call the whole key sequence is rotated at 0..key_len-1 and the
queries at key_len-query_len..key_len-1 (OLMo's RotaryEmbedding.forward).  The causal bias is
`triu(ones, 1) * finfo.min` for the full key length, sliced `[key_len - query_len:key_len, :key_len]`.
Weight tying: logits = F.linear(x, wte.weight).
Cache: hf tuples: `out = model(ids, use_cache=True)`, then
`model(tok, past_key_values=out.past_key_values, use_cache=True)`; logits in `out.logits`
(`out.attn_key_values` is the same tuple under OLMo's own name).  Correct.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": [
        "transformer.blocks.0",
        "transformer.blocks.1",
        "transformer.blocks.2",
    ],
    "kind": "causal-multihead",
    "cache": "hf",
    "style": "allenai/OLMo olmo/model.py: ModuleDict transformer (wte, blocks, ln_f), OLMoSequentialBlock computing "
    "attention itself (fused att_proj split by fused_dims, attn_out), GQA 4/2 repeat_interleave, rotary applied to "
    "the whole un-rotated key cache on each call, finfo.min causal bias sliced by key_len - query_len, tied wte",
}


class RMSLayerNorm(nn.Module):
    def __init__(self, size, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x):
        og_dtype = x.dtype
        x = x.to(torch.float32) if og_dtype != torch.float64 else x
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        return self.weight * x.to(og_dtype)


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, theta=10000.0):
        super().__init__()
        self.dim = dim
        self.theta = theta

    def get_rotary_embedding(self, seq_len, device, dtype):
        inv_freq = 1.0 / (
            self.theta ** (torch.arange(0, self.dim, 2, device=device, dtype=torch.float64) / self.dim)
        )
        seq = torch.arange(seq_len, device=device, dtype=torch.float64)
        freqs = torch.einsum("i , j -> i j", seq, inv_freq)
        positions = torch.cat((freqs, freqs), dim=-1)
        return positions.sin()[None, None].to(dtype), positions.cos()[None, None].to(dtype)

    def rotate_half(self, x):
        B, nh, T, hs = x.size()
        x = x.view(B, nh, T, 2, hs // 2)
        x1, x2 = x.unbind(dim=-2)
        return torch.cat((-x2, x1), dim=-1)

    def apply_rotary_pos_emb(self, pos_sin, pos_cos, t):
        return (t * pos_cos) + (self.rotate_half(t) * pos_sin)

    def forward(self, q, k):
        query_len, key_len = q.shape[-2], k.shape[-2]
        pos_sin, pos_cos = self.get_rotary_embedding(key_len, q.device, q.dtype)
        q_ = self.apply_rotary_pos_emb(
            pos_sin[:, :, key_len - query_len : key_len, :], pos_cos[:, :, key_len - query_len : key_len, :], q
        )
        k_ = self.apply_rotary_pos_emb(pos_sin, pos_cos, k)
        return q_, k_


class OLMoSequentialBlock(nn.Module):
    def __init__(self, layer_id, config):
        super().__init__()
        self.layer_id = layer_id
        self.config = config
        d = config.d_model
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = d // config.n_heads
        self.fused_dims = (d, self.n_kv_heads * self.head_dim, self.n_kv_heads * self.head_dim)
        self.att_proj = nn.Linear(d, sum(self.fused_dims), bias=False)
        self.attn_out = nn.Linear(d, d, bias=False)
        self.ff_proj = nn.Linear(d, 2 * config.mlp_hidden, bias=False)
        self.ff_out = nn.Linear(config.mlp_hidden, d, bias=False)
        self.attn_norm = RMSLayerNorm(d)
        self.ff_norm = RMSLayerNorm(d)
        self.rotary_emb = RotaryEmbedding(self.head_dim, config.rope_theta)

    def _scaled_dot_product_attention(self, q, k, v, attn_mask):
        num_q_heads, num_kv_heads = q.size(1), k.size(1)
        if num_q_heads != num_kv_heads:
            k = k.repeat_interleave(num_q_heads // num_kv_heads, dim=1, output_size=num_q_heads)
            v = v.repeat_interleave(num_q_heads // num_kv_heads, dim=1, output_size=num_q_heads)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=0.0, is_causal=False)

    def attention(self, q, k, v, attention_bias, layer_past=None, use_cache=False):
        B, T, C = q.size()
        dtype = k.dtype
        q = q.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)
        k = k.view(B, T, self.n_kv_heads, C // self.n_heads).transpose(1, 2)
        v = v.view(B, T, self.n_kv_heads, C // self.n_heads).transpose(1, 2)
        if layer_past is not None:
            past_key, past_value = layer_past
            k = torch.cat((past_key, k), dim=-2)
            v = torch.cat((past_value, v), dim=-2)
        present = (k, v) if use_cache else None
        query_len, key_len = q.shape[-2], k.shape[-2]
        q, k = self.rotary_emb(q, k)
        attention_bias = attention_bias[:, :, key_len - query_len : key_len, :key_len].to(dtype)
        att = self._scaled_dot_product_attention(q, k, v, attn_mask=attention_bias)
        att = att.transpose(1, 2).contiguous().view(B, T, C)
        return self.attn_out(att), present

    def forward(self, x, attention_bias, layer_past=None, use_cache=False):
        q, k, v = self.att_proj(self.attn_norm(x)).split(self.fused_dims, dim=-1)
        att, cache = self.attention(q, k, v, attention_bias, layer_past=layer_past, use_cache=use_cache)
        x = x + att
        og_x = x
        x = self.ff_proj(self.ff_norm(x))
        x, x_gate = x.chunk(2, dim=-1)
        x = self.ff_out(F.silu(x_gate) * x)
        return og_x + x, cache


def get_causal_attention_bias(seq_len, device, dtype):
    att_bias = torch.triu(torch.ones(seq_len, seq_len, device=device, dtype=torch.float), diagonal=1)
    return att_bias.view(1, 1, seq_len, seq_len).to(dtype) * torch.finfo(dtype).min


class OLMo(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.embedding_size, config.d_model),
                blocks=nn.ModuleList([OLMoSequentialBlock(i, config) for i in range(config.n_layers)]),
                ln_f=RMSLayerNorm(config.d_model),
            )
        )

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        batch_size, seq_len = input_ids.size()
        past_length = 0 if past_key_values is None else past_key_values[0][0].size(-2)
        x = self.transformer.wte(input_ids)
        attention_bias = get_causal_attention_bias(past_length + seq_len, x.device, x.dtype)
        attn_key_values = [] if use_cache else None
        for block_idx, block in enumerate(self.transformer.blocks):
            layer_past = None if past_key_values is None else past_key_values[block_idx]
            x, cache = block(x, attention_bias=attention_bias, layer_past=layer_past, use_cache=use_cache)
            if attn_key_values is not None:
                attn_key_values.append(cache)
        x = self.transformer.ln_f(x)
        logits = F.linear(x, self.transformer.wte.weight, None)
        kv = tuple(attn_key_values) if use_cache else None
        return SimpleNamespace(logits=logits, attn_key_values=kv, past_key_values=kv)


def make_model():
    torch.manual_seed(1801)
    config = SimpleNamespace(
        d_model=64, n_heads=4, n_kv_heads=2, n_layers=3, mlp_hidden=128,
        embedding_size=96, rope_theta=10000.0,
    )
    model = OLMo(config)
    g = torch.Generator().manual_seed(18011)
    with torch.no_grad():
        model.transformer.wte.weight.normal_(0.0, 0.5, generator=g)
        for m in model.modules():
            if isinstance(m, RMSLayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

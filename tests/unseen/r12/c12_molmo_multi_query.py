"""allenai/molmo (OLMo-derived LLM code) style MolmoSequentialBlock attention with grouped-query heads:
one fused att_proj (bias, Qwen2-style) split by fused_dims (d_model, kv_dim, kv_dim), heads via
view(B, T, n, hs).transpose(1, 2), the OLMo RotaryEmbedding (cat(freqs, freqs) sin/cos, rotate_half
by unflatten(-1, (2, hs // 2)).unbind(-2), theta 1e6) applied in the block's rotary_emb, the
model-built causal attention bias (triu(ones, 1) filled with finfo.min) sliced to
[:, :, k_len - q_len : k_len, :k_len], GQA by repeat_interleave in _scaled_dot_product_attention,
F.scaled_dot_product_attention with the float bias, transpose/view back and attn_out.

This file: correct."""

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass
class ModelConfig:
    d_model: int = 64
    n_heads: int = 4
    n_kv_heads: int = 1
    rope_theta: float = 1000000.0
    qkv_bias: bool = True
    max_sequence_length: int = 128
    n_layers: int = 1


class RMSLayerNorm(nn.Module):
    def __init__(self, size, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        return self.weight * x


class RotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.dim = config.d_model // config.n_heads

    def get_rotary_embedding(self, seq_len, device):
        inv_freq = 1.0 / (
            self.config.rope_theta
            ** (torch.arange(0, self.dim, 2, device=device, dtype=torch.float64) / self.dim)
        )
        seq = torch.arange(seq_len, device=device, dtype=torch.float64)
        freqs = torch.einsum("i , j -> i j", seq, inv_freq)
        positions = torch.cat((freqs, freqs), dim=-1)
        return positions.sin()[None, None, :, :], positions.cos()[None, None, :, :]

    def rotate_half(self, x):
        B, nh, T, hs = x.size()
        x = x.view(B, nh, T, 2, hs // 2)
        x1, x2 = x.unbind(dim=-2)
        return torch.cat((-x2, x1), dim=-1)

    def apply_rotary_pos_emb(self, pos_sin, pos_cos, t):
        return ((t * pos_cos) + (self.rotate_half(t) * pos_sin)).to(t.dtype)

    def forward(self, q, k):
        query_len, key_len = q.shape[-2], k.shape[-2]
        pos_sin, pos_cos = self.get_rotary_embedding(key_len, q.device)
        pos_sin = pos_sin.type_as(q)
        pos_cos = pos_cos.type_as(q)
        q_ = self.apply_rotary_pos_emb(
            pos_sin[:, :, key_len - query_len : key_len, :],
            pos_cos[:, :, key_len - query_len : key_len, :],
            q,
        )
        k_ = self.apply_rotary_pos_emb(pos_sin, pos_cos, k)
        return q_, k_


def causal_attention_bias(seq_len, device):
    att_bias = torch.triu(
        torch.ones(seq_len, seq_len, device=device, dtype=torch.float), diagonal=1
    )
    att_bias.masked_fill_(att_bias == 1, torch.finfo(att_bias.dtype).min)
    return att_bias.view(1, 1, seq_len, seq_len)


class MolmoSequentialBlock(nn.Module):
    def __init__(self, layer_id, config):
        super().__init__()
        self.layer_id = layer_id
        self.config = config
        head_dim = config.d_model // config.n_heads
        self.fused_dims = (
            config.d_model,
            config.n_kv_heads * head_dim,
            config.n_kv_heads * head_dim,
        )
        self.att_proj = nn.Linear(config.d_model, sum(self.fused_dims), bias=config.qkv_bias)
        self.attn_out = nn.Linear(config.d_model, config.d_model, bias=False)
        self.attn_norm = RMSLayerNorm(config.d_model)
        self.ff_norm = RMSLayerNorm(config.d_model)
        self.ff_proj = nn.Linear(config.d_model, 4 * config.d_model, bias=False)
        self.ff_out = nn.Linear(2 * config.d_model, config.d_model, bias=False)
        self.rotary_emb = RotaryEmbedding(config)

    def _scaled_dot_product_attention(self, q, k, v, attn_mask=None, is_causal=False):
        if k.size(1) != q.size(1):
            n_rep = q.size(1) // k.size(1)
            k = k.repeat_interleave(n_rep, dim=1, output_size=q.size(1))
            v = v.repeat_interleave(n_rep, dim=1, output_size=q.size(1))
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=0.0, is_causal=is_causal
        )

    def attention(self, q, k, v, attention_bias=None):
        B, T, C = q.size()
        dtype = k.dtype
        q = q.view(B, T, self.config.n_heads, C // self.config.n_heads).transpose(1, 2)
        k = k.view(B, T, self.config.n_kv_heads, C // self.config.n_heads).transpose(1, 2)
        v = v.view(B, T, self.config.n_kv_heads, C // self.config.n_heads).transpose(1, 2)
        q, k = self.rotary_emb(q, k)
        if attention_bias is not None:
            query_len, key_len = q.shape[-2], k.shape[-2]
            attention_bias = attention_bias[:, :, key_len - query_len : key_len, :key_len].to(dtype)
        att = self._scaled_dot_product_attention(
            q, k, v, attn_mask=attention_bias, is_causal=attention_bias is None
        )
        att = att.transpose(1, 2).contiguous().view(B, T, C)
        return self.attn_out(att)

    def forward(self, x, attention_bias=None):
        qkv = self.att_proj(self.attn_norm(x))
        q, k, v = qkv.split(self.fused_dims, dim=-1)
        x = x + self.attention(q, k, v, attention_bias)
        og_x = x
        x = self.ff_norm(x)
        x, x_gate = self.ff_proj(x).chunk(2, dim=-1)
        x = self.ff_out(F.silu(x_gate) * x)
        return og_x + x


class MolmoTransformer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList(
            [MolmoSequentialBlock(i, config) for i in range(config.n_layers)]
        )
        self.ln_f = RMSLayerNorm(config.d_model)

    def forward(self, x):
        seq_len = x.shape[1]
        attention_bias = causal_attention_bias(self.config.max_sequence_length, x.device)
        attention_bias = attention_bias[:, :, :seq_len, :seq_len]
        for block in self.blocks:
            x = block(x, attention_bias)
        return self.ln_f(x)


def make_molmo():
    torch.manual_seed(1208)
    model = MolmoTransformer(ModelConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, RMSLayerNorm):
                mod.weight.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {
    "target": "make_molmo",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "blocks.0",
    "structure": {
        "heads": 4,
        "kv_heads": 1,
        "head_dim": 16,
        "causal": True,
        "cross": False,
        "rope": {"pairing": "half", "fraction": 1.0, "base": 1000000},
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "allenai/molmo MolmoSequentialBlock as c08 with n_kv_heads = 1 (multi-query): fused_dims "
    "(64, 16, 16), repeat_interleave to 4 heads, rotary theta 1e6, model-built finfo.min "
    "causal bias",
}

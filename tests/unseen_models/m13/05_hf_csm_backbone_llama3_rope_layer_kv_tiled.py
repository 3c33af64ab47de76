"""Sesame CSM backbone used as a plain causal LM, after transformers' modeling_csm.py.

CsmBackboneForCausalLM here: backbone_model (CsmBackboneModel: embed_tokens, layers.N =
CsmDecoderLayer, norm, rotary_emb with "llama3" rope scaling: factor 8, low/high frequency factors 1/4,
original context 64, base 5e5) and lm_head.  CsmAttention: q/k/v/o bias-free, GQA 8/2 (head 8,
hidden 64), rotate_half, eager attention with a finfo.min causal mask.
Slip: layer 2 was given the "fast" key/value expansion `key_states.repeat(1, n_rep, 1, 1)` (tiling the
kv heads: query head h reads kv head h % 2) instead of repeat_kv (h // 4).  Layers 0 and 1 use repeat_kv.
No cache.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": [
        "backbone_model.layers.0.self_attn",
        "backbone_model.layers.1.self_attn",
        "backbone_model.layers.2.self_attn",
    ],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "backbone_model.layers.2.self_attn",
    "stage": "scores",
    "mistake": "kv_group_mapping",
    "style": "modeling_csm.py backbone: backbone_model tree, llama3 rope scaling, GQA 8/2; layer 2 expands kv "
    "heads with .repeat (tiled) instead of repeat_kv",
}


def _llama3_inv_freq(dim, base, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, old_context_len=64):
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


class CsmRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


class CsmRotaryEmbedding(nn.Module):
    def __init__(self, dim, base):
        super().__init__()
        self.register_buffer("inv_freq_fp64", _llama3_inv_freq(dim, base), persistent=False)

    def forward(self, x, position_ids):
        inv = _llama3_inv_freq(self.inv_freq_fp64.shape[0] * 2, 500000.0)
        freqs = position_ids[:, :, None].double() * inv[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class CsmAttention(nn.Module):
    def __init__(self, hidden, heads, kv_heads, head_dim, layer_idx, tiled_kv=False):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = head_dim
        self.num_key_value_groups = heads // kv_heads
        self.scaling = head_dim ** -0.5
        self.tiled_kv = tiled_kv
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    def forward(self, hidden_states, position_embeddings, attention_mask):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = (q * cos) + (rotate_half(q) * sin)
        k = (k * cos) + (rotate_half(k) * sin)
        if self.tiled_kv:
            k = k.repeat(1, self.num_key_value_groups, 1, 1)
            v = v.repeat(1, self.num_key_value_groups, 1, 1)
        else:
            k = repeat_kv(k, self.num_key_value_groups)
            v = repeat_kv(v, self.num_key_value_groups)
        attn_weights = torch.matmul(q, k.transpose(2, 3)) * self.scaling
        attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, v).transpose(1, 2).contiguous()
        return self.o_proj(attn_output.reshape(*input_shape, -1))


class CsmMLP(nn.Module):
    def __init__(self, hidden, inter):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class CsmDecoderLayer(nn.Module):
    def __init__(self, layer_idx):
        super().__init__()
        self.self_attn = CsmAttention(64, 8, 2, 8, layer_idx, tiled_kv=(layer_idx == 2))
        self.mlp = CsmMLP(64, 128)
        self.input_layernorm = CsmRMSNorm(64)
        self.post_attention_layernorm = CsmRMSNorm(64)

    def forward(self, hidden_states, position_embeddings, attention_mask):
        hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states), position_embeddings,
                                                       attention_mask)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class CsmBackboneModel(nn.Module):
    def __init__(self, vocab=97):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, 64)
        self.layers = nn.ModuleList([CsmDecoderLayer(i) for i in range(3)])
        self.norm = CsmRMSNorm(64)
        self.rotary_emb = CsmRotaryEmbedding(8, 500000.0)

    def forward(self, input_ids):
        h = self.embed_tokens(input_ids)
        T = input_ids.shape[1]
        position_ids = torch.arange(T, device=input_ids.device).unsqueeze(0)
        mask = torch.full((T, T), torch.finfo(h.dtype).min, dtype=h.dtype, device=h.device).triu(1)[None, None]
        pe = self.rotary_emb(h, position_ids)
        for layer in self.layers:
            h = layer(h, pe, mask)
        return self.norm(h)


class CsmBackboneForCausalLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone_model = CsmBackboneModel()
        self.lm_head = nn.Linear(64, 97, bias=False)

    def forward(self, input_ids):
        return self.lm_head(self.backbone_model(input_ids))


def make_model():
    torch.manual_seed(1305)
    model = CsmBackboneForCausalLM()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, CsmRMSNorm):
                m.weight.copy_(1.0 + 0.2 * torch.randn_like(m.weight))
    return model.eval()

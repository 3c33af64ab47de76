"""HF Gemma 3n text attention (Gemma3nTextAttention): per-head q_norm/k_norm with learned scale, plus
v_norm, an RMSNorm without scale applied to every value head, and scaling = 1.0 (the QK norms take the
place of 1/sqrt(d)). GQA 4:2, rotate_half RoPE, sliding-window-free full-attention layer, causal.

This file: refused (values are RMS-normalised per head before the weighted sum)."""

import torch
from torch import nn


class Gemma3nTextConfig:
    hidden_size = 64
    num_attention_heads = 4
    num_key_value_heads = 2
    head_dim = 16
    rope_theta = 1000000.0
    rms_norm_eps = 1e-6
    intermediate_size = 128


class Gemma3nRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6, with_scale=True):
        super().__init__()
        self.eps = eps
        self.with_scale = with_scale
        if with_scale:
            self.weight = nn.Parameter(torch.ones(dim))
        else:
            self.register_buffer("weight", torch.tensor(1.0), persistent=False)

    def forward(self, x):
        out = x * torch.pow(x.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        return out * self.weight.to(x.dtype)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class Gemma3nTextAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = 1.0
        self.q_proj = nn.Linear(
            config.hidden_size, config.num_attention_heads * self.head_dim, bias=False
        )
        self.k_proj = nn.Linear(
            config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False
        )
        self.v_proj = nn.Linear(
            config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False
        )
        self.o_proj = nn.Linear(
            config.num_attention_heads * self.head_dim, config.hidden_size, bias=False
        )
        self.q_norm = Gemma3nRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Gemma3nRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.v_norm = Gemma3nRMSNorm(self.head_dim, eps=config.rms_norm_eps, with_scale=False)

    def forward(self, hidden_states, position_embeddings, attention_mask):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        cos, sin = position_embeddings
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)

        q = self.q_norm(self.q_proj(hidden_states).view(hidden_shape))
        q = (q * cos + rotate_half(q) * sin).transpose(1, 2)
        k = self.k_norm(self.k_proj(hidden_states).view(hidden_shape))
        k = (k * cos + rotate_half(k) * sin).transpose(1, 2)
        v = self.v_norm(self.v_proj(hidden_states).view(hidden_shape)).transpose(1, 2)

        k = k.repeat_interleave(self.num_key_value_groups, dim=1)
        v = v.repeat_interleave(self.num_key_value_groups, dim=1)
        w = torch.matmul(q, k.transpose(2, 3)) * self.scaling + attention_mask
        w = torch.softmax(w, dim=-1)
        out = torch.matmul(w, v).transpose(1, 2).reshape(*input_shape, -1)
        return self.o_proj(out)


class Gemma3nDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = Gemma3nTextAttention(config)
        self.input_layernorm = Gemma3nRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = Gemma3nRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, position_embeddings, attention_mask):
        return x + self.post_attention_layernorm(
            self.self_attn(self.input_layernorm(x), position_embeddings, attention_mask)
        )


class Gemma3nTextModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList([Gemma3nDecoderLayer(config)])
        self.norm = Gemma3nRMSNorm(config.hidden_size, config.rms_norm_eps)
        inv_freq = 1.0 / (
            config.rope_theta
            ** (torch.arange(0, config.head_dim, 2, dtype=torch.float64) / config.head_dim)
        )
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, inputs_embeds):
        n = inputs_embeds.shape[1]
        dtype = inputs_embeds.dtype
        freqs = torch.arange(n, dtype=torch.float64)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[None]
        pe = (emb.cos().to(dtype), emb.sin().to(dtype))
        mask = torch.triu(torch.full((n, n), torch.finfo(dtype).min, dtype=dtype), diagonal=1)[
            None, None
        ]
        h = inputs_embeds
        for layer in self.layers:
            h = layer(h, pe, mask)
        return self.norm(h)


def make_gemma3n_text():
    torch.manual_seed(1552)
    model = Gemma3nTextModel(Gemma3nTextConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, Gemma3nRMSNorm) and mod.with_scale:
                mod.weight.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {
    "target": "make_gemma3n_text",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "layers.0.self_attn",
    "unsupported": "value_norm",
    "style": "HF Gemma 3n Gemma3nTextAttention: per-head q_norm/k_norm, v_norm (RMSNorm without scale) on "
    "the value heads, scaling 1.0, GQA 4:2 by repeat_interleave, rotate_half RoPE",
}

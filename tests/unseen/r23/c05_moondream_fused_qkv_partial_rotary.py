"""Moondream (vikhyat/moondream, moondream/torch text.py + layers.py) text attention: one fused `qkv`
Linear split as [q_dim, kv_dim, kv_dim], n_kv_heads, moondream's precompute_freqs_cis (a stacked
(cos, sin) table, float64 here) and apply_rotary_emb(x, freqs_cis, position_ids, num_heads,
interleave=False) that rotates the first rot_dim channels of each head (first half of rot_dim
against the second) and passes the rest through, F.scaled_dot_product_attention with the boolean
tril mask the text model builds, `proj`. Phi-style parallel block: one LayerNorm, x + attn + mlp.
The attention is wrapped as a small module (moondream keeps its weights in ModuleDicts and calls a
function).

This file: correct (4 heads of 16, rot_dim 8: half of each head rotated, halves pairing)."""

import torch
import torch.nn.functional as F
from torch import nn


class TextConfig:
    dim = 64
    n_heads = 4
    n_kv_heads = 4
    rot_dim = 8  # of head_dim 16
    rope_theta = 10000.0
    max_context = 128
    ff_dim = 128


def precompute_freqs_cis(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64)[: (dim // 2)] / dim))
    t = torch.arange(end, dtype=torch.float64).unsqueeze(1)
    freqs = t * freqs.unsqueeze(0)
    cos, sin = torch.cos(freqs), torch.sin(freqs)
    return torch.stack([cos, sin], dim=-1)  # (end, dim // 2, 2)


def apply_rotary_emb(x, freqs_cis, position_ids, num_heads, interleave=False):
    assert num_heads == x.shape[1]
    rot_dim = freqs_cis.shape[-2] * 2
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    if interleave:
        xq_r = x_rot.reshape(*x_rot.shape[:-1], -1, 2)[..., 0]
        xq_i = x_rot.reshape(*x_rot.shape[:-1], -1, 2)[..., 1]
    else:
        d = x_rot.shape[-1] // 2
        xq_r, xq_i = x_rot[..., :d], x_rot[..., d:]
    freqs_cos = freqs_cis[..., 0][position_ids, :].unsqueeze(0).unsqueeze(0).to(x.dtype)
    freqs_sin = freqs_cis[..., 1][position_ids, :].unsqueeze(0).unsqueeze(0).to(x.dtype)
    xq_out_r = xq_r * freqs_cos - xq_i * freqs_sin
    xq_out_i = xq_r * freqs_sin + xq_i * freqs_cos
    xq_out = torch.cat((xq_out_r, xq_out_i), dim=-1)
    return torch.cat([xq_out, x_pass], dim=-1)


def attn(x, w, freqs_cis, attn_mask, n_heads, n_kv_heads, position_ids):
    bsz, q_len, d_model = x.shape
    head_dim = d_model // n_heads

    qkv_out = w.qkv(x)
    q_dim = n_heads * head_dim
    kv_dim = n_kv_heads * head_dim
    q, k, v = qkv_out.split([q_dim, kv_dim, kv_dim], dim=-1)

    q = q.view(bsz, q_len, n_heads, head_dim).transpose(1, 2)
    k = k.view(bsz, q_len, n_kv_heads, head_dim).transpose(1, 2)
    v = v.view(bsz, q_len, n_kv_heads, head_dim).transpose(1, 2)

    q = apply_rotary_emb(q, freqs_cis, position_ids, n_heads)
    k = apply_rotary_emb(k, freqs_cis, position_ids, n_kv_heads)

    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=n_heads != n_kv_heads)
    out = out.transpose(1, 2).reshape(bsz, q_len, d_model)
    out = w.proj(out)
    return out


class Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        head_dim = config.dim // config.n_heads
        self.qkv = nn.Linear(config.dim, (config.n_heads + 2 * config.n_kv_heads) * head_dim)
        self.proj = nn.Linear(config.dim, config.dim)

    def forward(self, x, freqs_cis, attn_mask, position_ids):
        return attn(x, self, freqs_cis, attn_mask, self.n_heads, self.n_kv_heads, position_ids)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.fc1 = nn.Linear(config.dim, config.ff_dim)
        self.fc2 = nn.Linear(config.ff_dim, config.dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln = nn.LayerNorm(config.dim)
        self.attn = Attention(config)
        self.mlp = MLP(config)

    def forward(self, x, freqs_cis, attn_mask, position_ids):
        l_in = self.ln(x)
        l_attn = self.attn(l_in, freqs_cis, attn_mask, position_ids)
        l_mlp = self.mlp(l_in)
        return x + l_attn + l_mlp


class TextModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList([Block(config)])
        self.post_ln = nn.LayerNorm(config.dim)
        self.register_buffer(
            "freqs_cis",
            precompute_freqs_cis(config.rot_dim, config.max_context, config.rope_theta),
            persistent=False,
        )

    def forward(self, inputs_embeds):
        q_len = inputs_embeds.shape[1]
        position_ids = torch.arange(q_len, dtype=torch.long, device=inputs_embeds.device)
        attn_mask = torch.tril(torch.ones(1, 1, q_len, q_len, dtype=torch.bool, device=inputs_embeds.device))
        x = inputs_embeds
        for block in self.blocks:
            x = block(x, self.freqs_cis, attn_mask, position_ids)
        return self.post_ln(x)


def make_moondream_text():
    torch.manual_seed(2305)
    model = TextModel(TextConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.3, 0.3)
    return model.eval()


EXPECT = {
    "target": "make_moondream_text",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "blocks.0.attn",
    "structure": {
        "heads": 4,
        "kv_heads": 4,
        "head_dim": 16,
        "causal": True,
        "cross": False,
        "rope": {"pairing": "half", "fraction": 0.5, "base": 10000},
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "Moondream text attn: correct (fused qkv, rot_dim 8 of 16, SDPA with the model tril mask)",
}

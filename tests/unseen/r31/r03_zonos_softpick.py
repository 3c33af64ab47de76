"""Zyphra Zonos torch backbone (zonos/backbone/_torch.py, gpt-fast derived): TransformerBlock with
LayerNorm norm/norm2, Attention with one fused in_proj split [q_size, kv_size, kv_size], (b, s, heads,
head_dim) views, complex-pair rotary (precompute_freqs_cis cache of (cos, sin) pairs, interleaved
pairs), SDPA(is_causal=seqlen > 1, enable_gqa=True), out_proj; TorchZonosBackbone with norm_f.

This file: refused: softpick attention (rectified softmax ReLU(e^x - 1) / sum |e^x - 1|) in place of softmax, causal."""

import math

import torch
import torch.nn as nn
from torch.nn import functional as F


class BackboneConfig:
    d_model = 64
    d_intermediate = 128
    n_layer = 1
    norm_epsilon = 1e-5
    attn_cfg = {"num_heads": 4, "num_heads_kv": 2}
    rope_base = 10000


def precompute_freqs_cis(seq_len: int, n_elem: int, base: float = 10000) -> torch.Tensor:
    freqs = 1.0 / (base ** (torch.arange(0, n_elem, 2, dtype=torch.float64)[: (n_elem // 2)] / n_elem))
    t = torch.arange(seq_len, dtype=torch.float64)
    freqs = torch.outer(t, freqs)
    freqs_cis = torch.polar(torch.ones_like(freqs), freqs)
    cache = torch.stack([freqs_cis.real, freqs_cis.imag], dim=-1)
    return cache


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    xshaped = x.reshape(*x.shape[:-1], -1, 2)
    freqs_cis = freqs_cis.to(x.dtype).view(-1, xshaped.size(1), 1, xshaped.size(3), 2)
    x_out2 = torch.stack(
        [
            xshaped[..., 0] * freqs_cis[..., 0] - xshaped[..., 1] * freqs_cis[..., 1],
            xshaped[..., 1] * freqs_cis[..., 0] + xshaped[..., 0] * freqs_cis[..., 1],
        ],
        -1,
    )
    x_out2 = x_out2.flatten(3)
    return x_out2.type_as(x)


def softpick_attention(q, k, v, causal=True, eps=1e-6):
    """Softpick attention: rectified softmax ReLU(e^x - 1) / sum |e^x - 1|, computed with the row max
    factored out; masked keys contribute nothing to either sum."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    L, S = scores.shape[-2:]
    keep = torch.ones(L, S, dtype=torch.bool, device=q.device)
    if causal:
        keep = torch.tril(keep)
    m = scores.masked_fill(~keep, float("-inf")).amax(dim=-1, keepdim=True).detach()
    shifted = torch.exp(scores - m) - torch.exp(-m)
    shifted = shifted.masked_fill(~keep, 0.0)
    weights = torch.relu(shifted) / (shifted.abs().sum(dim=-1, keepdim=True) + eps)
    return torch.matmul(weights, v)


class Attention(nn.Module):
    """Zonos (gpt-fast derived) attention: one fused in_proj for q, k, v (kv with num_heads_kv heads),
    split by sizes, (b, s, heads, head_dim) views, complex-pair rotary on q and k, SDPA with
    enable_gqa, out_proj."""

    def __init__(self, num_heads: int, num_heads_kv: int, embed_dim: int, layer_idx: int):
        super().__init__()
        self.num_heads = num_heads
        self.num_heads_kv = num_heads_kv
        self.head_dim = embed_dim // num_heads
        self.layer_idx = layer_idx

        total_head_dim = (num_heads + 2 * num_heads_kv) * self.head_dim
        self.in_proj = nn.Linear(embed_dim, total_head_dim, bias=False)
        self.out_proj = nn.Linear(num_heads * self.head_dim, embed_dim, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        batch_size, seqlen, _ = x.shape

        q_size = self.num_heads * self.head_dim
        kv_size = self.num_heads_kv * self.head_dim
        q, k, v = self.in_proj(x).split([q_size, kv_size, kv_size], dim=-1)

        q = q.view(batch_size, seqlen, self.num_heads, self.head_dim)
        k = k.view(batch_size, seqlen, self.num_heads_kv, self.head_dim)
        v = v.view(batch_size, seqlen, self.num_heads_kv, self.head_dim)

        q = apply_rotary_emb(q, freqs_cis)
        k = apply_rotary_emb(k, freqs_cis)

        q, k, v = map(lambda x: x.transpose(1, 2), (q, k, v))
        y = softpick_attention(q, k, v, causal=seqlen > 1)

        y = y.transpose(1, 2).contiguous().view(batch_size, seqlen, q_size)

        y = self.out_proj(y)
        return y


class FeedForward(nn.Module):
    def __init__(self, d_model: int, d_inner: int):
        super().__init__()
        self.fc1 = nn.Linear(d_model, 2 * d_inner, bias=False)
        self.fc2 = nn.Linear(d_inner, d_model, bias=False)

    def forward(self, x):
        y, gate = self.fc1(x).chunk(2, dim=-1)
        return self.fc2(y * F.silu(gate))


class TransformerBlock(nn.Module):
    def __init__(self, config: BackboneConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.norm = nn.LayerNorm(config.d_model, eps=config.norm_epsilon)
        self.mixer = Attention(config.attn_cfg["num_heads"], config.attn_cfg["num_heads_kv"], config.d_model, layer_idx)
        self.norm2 = nn.LayerNorm(config.d_model, eps=config.norm_epsilon)
        self.mlp = FeedForward(config.d_model, config.d_intermediate)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        x = x + self.mixer(self.norm(x), freqs_cis)
        x = x + self.mlp(self.norm2(x))
        return x


class TorchZonosBackbone(nn.Module):
    def __init__(self, config: BackboneConfig):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(TransformerBlock(config, i) for i in range(config.n_layer))
        self.norm_f = nn.LayerNorm(config.d_model, eps=config.norm_epsilon)
        self.head_dim = config.d_model // config.attn_cfg["num_heads"]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        seqlen = hidden_states.shape[1]
        freqs_cis = precompute_freqs_cis(seqlen, self.head_dim, base=self.config.rope_base)
        freqs_cis = freqs_cis.to(hidden_states.device)
        for layer in self.layers:
            hidden_states = layer(hidden_states, freqs_cis)
        return self.norm_f(hidden_states)


def _init(model):
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


def make_zonos_backbone():
    torch.manual_seed(3131)
    config = BackboneConfig()
    return _init(TorchZonosBackbone(config))



EXPECT = {'target': 'make_zonos_backbone',
 'kind': 'causal-multihead',
 'ok': True,
 'layer': 'layers.0.mixer',
 'unsupported': 'softpick',
 'style': 'Zonos Attention (Zyphra/Zonos zonos/backbone/_torch.py): refused: softpick attention '
          '(rectified softmax ReLU(e^x - 1) / sum |e^x - 1|) in place of softmax, causal'}

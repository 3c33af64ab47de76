"""OLMo-core (allenai/OLMo-core, olmo_core/nn/attention and olmo_core/nn/rope) style attention:
separate w_q/w_k/w_v/w_out, optional QK norm over the full projection (OLMo 2) or per head
(use_head_qk_norm), RotaryEmbedding with rotate_half on (B, T, H, D) tensors (head_first=False),
a torch SDPA backend with flash-attn style window_size tuples (left, right) for sliding-window
layers (OLMo 3), GQA by repeat_interleave, pre-norm TransformerBlock with attention_norm.

This file: one bug: the merged heads are returned without w_out."""

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class AttentionConfig:
    d_model: int = 64
    n_heads: int = 4
    n_kv_heads: int = 2
    qk_norm: bool = True
    use_head_qk_norm: bool = False
    rope_theta: int = 500000
    window_size: Optional[int] = None
    layer_norm_eps: float = 1e-6


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        og_dtype = x.dtype
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        return (self.weight * x).to(og_dtype)


class RotaryEmbedding(nn.Module):
    """Rotary embedding in the "halves" layout, like olmo_core.nn.rope.RotaryEmbedding."""

    def __init__(self, head_size: int, theta: int = 500_000):
        super().__init__()
        self.dim = head_size
        self.theta = theta

    def get_buffers(self, seq_len: int, device, dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        inv_freq = 1.0 / (
            self.theta ** (torch.arange(0, self.dim, 2, device=device, dtype=torch.float64) / self.dim)
        )
        seq = torch.arange(seq_len, device=device, dtype=torch.float64)
        freqs = torch.einsum("i , j -> i j", seq, inv_freq)
        positions = torch.cat((freqs, freqs), dim=-1)
        return positions.sin().to(dtype), positions.cos().to(dtype)

    def rotate_half(self, x: torch.Tensor) -> torch.Tensor:
        B, T, nh, hs = x.size()
        x = x.view(B, T, nh, 2, hs // 2)
        x1, x2 = x.unbind(dim=-2)
        return torch.cat((-x2, x1), dim=-1)

    def apply_rotary_pos_emb(self, pos_sin, pos_cos, t):
        return (t * pos_cos) + (self.rotate_half(t) * pos_sin)

    def forward(self, q, k, head_first: bool = False, start_pos: Optional[int] = None):
        # q, k: (B, T, n_heads, head_dim) when head_first is False
        q_len, k_len = q.shape[1], k.shape[1]
        pos_sin, pos_cos = self.get_buffers(k_len + 1, q.device, q.dtype)
        q_start = 0 if start_pos is None else start_pos
        q_abs = self.apply_rotary_pos_emb(
            pos_sin[None, q_start : q_start + q_len, None, :],
            pos_cos[None, q_start : q_start + q_len, None, :],
            q,
        )
        k_abs = self.apply_rotary_pos_emb(
            pos_sin[None, :k_len, None, :], pos_cos[None, :k_len, None, :], k
        )
        return q_abs, k_abs


class TorchAttentionBackend:
    """Plain-torch fallback of the flash-attn backend (q, k, v in (B, T, H, D))."""

    @staticmethod
    def sdpa(q, k, v, scale, window_size: Tuple[int, int]):
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        n_rep = q.shape[1] // k.shape[1]
        if n_rep > 1:
            k = k.repeat_interleave(n_rep, dim=1, output_size=q.shape[1])
            v = v.repeat_interleave(n_rep, dim=1, output_size=q.shape[1])
        T, S = q.shape[2], k.shape[2]
        if window_size == (-1, -1):
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        else:
            i = torch.arange(T, device=q.device)[:, None]
            j = torch.arange(S, device=q.device)[None, :]
            allowed = (j <= i) & (i - j <= window_size[0])
            att = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
        return att.transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, config: AttentionConfig):
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.d_model // config.n_heads
        self.w_q = nn.Linear(config.d_model, self.n_heads * self.head_dim, bias=False)
        self.w_k = nn.Linear(config.d_model, self.n_kv_heads * self.head_dim, bias=False)
        self.w_v = nn.Linear(config.d_model, self.n_kv_heads * self.head_dim, bias=False)
        self.w_out = nn.Linear(self.n_heads * self.head_dim, config.d_model, bias=False)
        self.use_head_qk_norm = config.use_head_qk_norm
        self.q_norm = self.k_norm = None
        if config.qk_norm:
            q_size = self.head_dim if self.use_head_qk_norm else self.n_heads * self.head_dim
            k_size = self.head_dim if self.use_head_qk_norm else self.n_kv_heads * self.head_dim
            self.q_norm = RMSNorm(q_size, config.layer_norm_eps)
            self.k_norm = RMSNorm(k_size, config.layer_norm_eps)
        self.rope = RotaryEmbedding(self.head_dim, theta=config.rope_theta)
        if config.window_size is not None and config.window_size > 0:
            # flash-attn convention: (left, right) keys visible besides the query's own
            self.window_size = (config.window_size - 1, 0)
        else:
            self.window_size = (-1, -1)
        self.backend = TorchAttentionBackend()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.w_q(x), self.w_k(x), self.w_v(x)
        if self.q_norm is not None and not self.use_head_qk_norm:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = q.view(B, T, -1, self.head_dim)
        k = k.view(B, T, -1, self.head_dim)
        v = v.view(B, T, -1, self.head_dim)
        if self.q_norm is not None and self.use_head_qk_norm:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q, k = self.rope(q, k, head_first=False)
        att = self.backend.sdpa(q, k, v, scale=1.0 / math.sqrt(self.head_dim), window_size=self.window_size)
        att = att.reshape(B, T, -1)
        return att


class FeedForward(nn.Module):
    def __init__(self, d_model: int, hidden_size: int):
        super().__init__()
        self.w1 = nn.Linear(d_model, hidden_size, bias=False)
        self.w2 = nn.Linear(hidden_size, d_model, bias=False)
        self.w3 = nn.Linear(d_model, hidden_size, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, config: AttentionConfig):
        super().__init__()
        self.attention = Attention(config)
        self.attention_norm = RMSNorm(config.d_model, config.layer_norm_eps)
        self.feed_forward = FeedForward(config.d_model, 128)
        self.feed_forward_norm = RMSNorm(config.d_model, config.layer_norm_eps)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.feed_forward_norm(h))


class Transformer(nn.Module):
    def __init__(self, config: AttentionConfig):
        super().__init__()
        self.blocks = nn.ModuleDict({"0": TransformerBlock(config)})
        self.lm_head_norm = RMSNorm(config.d_model, config.layer_norm_eps)

    def forward(self, inputs_embeds):
        h = inputs_embeds
        for block in self.blocks.values():
            h = block(h)
        return self.lm_head_norm(h)


def make_olmo_core_transformer():
    torch.manual_seed(3098)
    model = Transformer(AttentionConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, RMSNorm):
                mod.weight.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {'target': 'make_olmo_core_transformer',
 'kind': 'causal-multihead',
 'ok': False,
 'layer': 'blocks.0.attention',
 'stage': 'output',
 'mistake': 'missing_out_proj',
 'style': 'OLMo-core Attention (olmo_core/nn/attention): w_out built but the merged heads returned '
          'directly'}

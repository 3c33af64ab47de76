"""fish-speech (fishaudio `fish_speech/models/text2semantic/llama.py`) slow-transformer Attention:
fused `wqkv` split into q/kv sizes, (b, s, h, d) views, optional per-head q_norm/k_norm RMSNorm,
`apply_rotary_emb` on a stacked (cos, sin) `freqs_cis` cache (interleaved pairs), transpose,
`repeat_interleave` GQA, SDPA with the model's boolean tril mask (or the
`eq_scaled_dot_product_attention` fallback), `wo`; pre-norm `TransformerBlock`.

This file: apply_rotary_emb rewritten with rotate_half (halves) while the cos/sin cache is expanded pairwise (interleaved layout)."""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class BaseModelArgs:
    vocab_size: int = 256
    dim: int = 64
    n_layer: int = 1
    n_head: int = 4
    n_local_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 160
    rope_base: float = 1000000.0
    norm_eps: float = 1e-6
    max_seq_len: int = 128
    dropout: float = 0.0
    attention_qkv_bias: bool = False
    attention_o_bias: bool = False
    attention_qk_norm: bool = False
    attention_output_gate: bool = False
    use_sdpa: bool = True


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + self.eps)

    def forward(self, x):
        return self._norm(x) * self.weight


def precompute_freqs_cis(seq_len: int, n_elem: int, base: float = 10000.0):
    # table kept in float64 and cast to the activations' dtype where it is used
    freqs = 1.0 / (
        base ** (torch.arange(0, n_elem, 2, dtype=torch.float64)[: (n_elem // 2)] / n_elem)
    )
    t = torch.arange(seq_len, dtype=torch.float64)
    freqs = torch.outer(t, freqs)
    freqs_cis = torch.polar(torch.ones_like(freqs), freqs)
    return torch.stack([freqs_cis.real, freqs_cis.imag], dim=-1)


def apply_rotary_emb(x, freqs_cis):
    # HF-converter variant: expand the (cos, sin) cache pairwise and use rotate_half
    cos = freqs_cis[..., 0].to(x.dtype).repeat_interleave(2, dim=-1)[None, :, None, :]
    sin = freqs_cis[..., 1].to(x.dtype).repeat_interleave(2, dim=-1)[None, :, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x * cos + rotated * sin).type_as(x)


class FeedForward(nn.Module):
    def __init__(self, config: BaseModelArgs):
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.intermediate_size, bias=False)
        self.w3 = nn.Linear(config.dim, config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Attention(nn.Module):
    def __init__(self, config: BaseModelArgs, use_sdpa: bool = True):
        super().__init__()
        assert config.dim % config.n_head == 0
        total_head_dim = (config.n_head + 2 * config.n_local_heads) * config.head_dim
        self.wqkv = nn.Linear(config.dim, total_head_dim, bias=config.attention_qkv_bias)
        self.wo = nn.Linear(config.n_head * config.head_dim, config.dim, bias=config.attention_o_bias)
        if config.attention_output_gate:
            self.wgate = nn.Linear(config.dim, config.n_head * config.head_dim, bias=False)
        self.kv_cache = None
        if config.attention_qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.norm_eps)
        self.dropout = config.dropout
        self.n_head = config.n_head
        self.head_dim = config.head_dim
        self.n_local_heads = config.n_local_heads
        self.dim = config.dim
        self.use_sdpa = use_sdpa
        self.attention_qk_norm = config.attention_qk_norm
        self.attention_output_gate = config.attention_output_gate

    def forward(self, x, freqs_cis, mask, input_pos=None):
        bsz, seqlen, _ = x.shape

        q_size = self.n_head * self.head_dim
        kv_size = self.n_local_heads * self.head_dim
        q, k, v = self.wqkv(x).split([q_size, kv_size, kv_size], dim=-1)

        q = q.view(bsz, seqlen, self.n_head, self.head_dim)
        k = k.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        v = v.view(bsz, seqlen, self.n_local_heads, self.head_dim)

        if self.attention_qk_norm:
            q = self.q_norm(q)
            k = self.k_norm(k)

        q = apply_rotary_emb(q, freqs_cis)
        k = apply_rotary_emb(k, freqs_cis)

        q, k, v = map(lambda t: t.transpose(1, 2), (q, k, v))

        if self.kv_cache is not None:
            k, v = self.kv_cache.update(input_pos, k, v)

        k = k.repeat_interleave(self.n_head // self.n_local_heads, dim=1)
        v = v.repeat_interleave(self.n_head // self.n_local_heads, dim=1)

        if self.use_sdpa:
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0
            )
        else:
            y = self.eq_scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0
            )

        y = y.transpose(1, 2).contiguous().view(bsz, seqlen, q_size)
        if self.attention_output_gate:
            y = y * torch.sigmoid(self.wgate(x))

        return self.wo(y)

    def eq_scaled_dot_product_attention(self, query, key, value, attn_mask=None, dropout_p=0.0):
        # the "equivalent" path fish-speech keeps for backends without SDPA
        L, S = query.size(-2), key.size(-2)
        scale_factor = 1 / math.sqrt(query.size(-1))
        attn_bias = torch.zeros(1, 1, L, S, dtype=query.dtype, device=query.device)

        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                attn_bias.masked_fill_(attn_mask.logical_not(), float("-inf"))
            else:
                attn_bias += attn_mask

        attn_weight = query @ key.transpose(-2, -1) * scale_factor
        attn_weight += attn_bias
        attn_weight = torch.softmax(attn_weight, dim=-1)
        attn_weight = torch.dropout(attn_weight, dropout_p, train=self.training)

        return attn_weight @ value


class TransformerBlock(nn.Module):
    def __init__(self, config: BaseModelArgs, use_sdpa: bool = True):
        super().__init__()
        self.attention = Attention(config, use_sdpa=use_sdpa)
        self.feed_forward = FeedForward(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)

    def forward(self, x, freqs_cis, mask, input_pos=None):
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask, input_pos)
        return h + self.feed_forward(self.ffn_norm(h))


class BaseTransformer(nn.Module):
    """Slow (token-axis) transformer of fish-speech's DualAR model, fed with embeddings."""

    def __init__(self, config: BaseModelArgs):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(
            TransformerBlock(config, use_sdpa=config.use_sdpa) for _ in range(config.n_layer)
        )
        self.norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.register_buffer(
            "freqs_cis",
            precompute_freqs_cis(config.max_seq_len, config.head_dim, config.rope_base),
            persistent=False,
        )
        self.register_buffer(
            "causal_mask",
            torch.tril(torch.ones(config.max_seq_len, config.max_seq_len, dtype=torch.bool)),
            persistent=False,
        )

    def forward(self, x):
        seq_len = x.size(1)
        mask = self.causal_mask[None, None, :seq_len, :seq_len]
        freqs_cis = self.freqs_cis[:seq_len]
        for layer in self.layers:
            x = layer(x, freqs_cis, mask)
        return self.norm(x)


def make_fish_slow_transformer():
    torch.manual_seed(2903)
    model = BaseTransformer(BaseModelArgs())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, RMSNorm):
                mod.weight.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {'target': 'make_fish_slow_transformer',
 'kind': 'causal-multihead',
 'ok': False,
 'layer': 'layers.0.attention',
 'stage': 'rotated_queries',
 'mistake': 'rope_pairing',
 'style': 'fish-speech Attention (text2semantic llama.py): apply_rotary_emb rewritten with '
          'rotate_half (halves) while the cos/sin cache is expanded pairwise (interleaved layout)'}

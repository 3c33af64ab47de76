"""gemma_pytorch (google/gemma_pytorch) style GemmaAttention in a one-layer model body: fused
qkv_proj split [q | k | v], apply_rotary_emb that chunks each head into halves and stacks them as
complex numbers (so the rotation pairs d with d + head_dim/2), repeat_interleave for GQA 4:2,
q.mul(scaling) with scaling = query_pre_attn_scalar**-0.5, an additive mask the model builds with
-2.3819763e38 (triu diagonal=1) and RMSNorm x * (1 + weight). Global layer (no sliding window applied)."""

import dataclasses
import enum

import torch
import torch.nn.functional as F
from torch import nn


class AttentionType(enum.Enum):
    GLOBAL = 1
    LOCAL_SLIDING = 2


@dataclasses.dataclass
class GemmaConfig:
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    max_position_embeddings: int = 128
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    query_pre_attn_scalar: int = 16
    sliding_window_size: int = 8
    attn_type: AttentionType = AttentionType.GLOBAL


def precompute_freqs_cis(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].double() / dim))
    t = torch.arange(end).double()
    freqs = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_emb(x, freqs_cis):
    x_ = torch.view_as_complex(
        torch.stack(torch.chunk(x.transpose(1, 2).double(), 2, dim=-1), dim=-1)
    )
    x_out = torch.view_as_real(x_ * freqs_cis).type_as(x)
    x_out = torch.cat(torch.chunk(x_out, 2, dim=-1), dim=-2)
    x_out = x_out.reshape(x_out.shape[0], x_out.shape[1], x_out.shape[2], -1).transpose(1, 2)
    return x_out


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        return self._norm(x) * (1 + self.weight)


class GemmaAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.num_queries_per_kv = self.num_heads // self.num_kv_heads
        self.hidden_size = config.hidden_size
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scaling = config.query_pre_attn_scalar**-0.5
        self.qkv_proj = nn.Linear(
            self.hidden_size, (self.num_heads + 2 * self.num_kv_heads) * self.head_dim, bias=False
        )
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=False)
        self.attn_type = config.attn_type
        self.sliding_window_size = config.sliding_window_size

    def forward(self, hidden_states, freqs_cis, mask):
        batch_size, input_len, _ = hidden_states.shape
        qkv = self.qkv_proj(hidden_states)
        xq, xk, xv = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        xq = xq.view(batch_size, -1, self.num_heads, self.head_dim)
        xk = xk.view(batch_size, -1, self.num_kv_heads, self.head_dim)
        xv = xv.view(batch_size, -1, self.num_kv_heads, self.head_dim)
        xq = apply_rotary_emb(xq, freqs_cis=freqs_cis)
        xk = apply_rotary_emb(xk, freqs_cis=freqs_cis)
        key = xk
        value = xv
        if self.num_kv_heads != self.num_heads:
            key = torch.repeat_interleave(key, self.num_queries_per_kv, dim=2)
            value = torch.repeat_interleave(value, self.num_queries_per_kv, dim=2)
        q = xq.transpose(1, 2)
        k = key.transpose(1, 2)
        v = value.transpose(1, 2)
        q = q.mul(self.scaling)
        scores = torch.matmul(q, k.transpose(2, 3))
        if self.attn_type == AttentionType.LOCAL_SLIDING and self.sliding_window_size is not None:
            all_ones = torch.ones_like(mask)
            sliding_mask = torch.triu(all_ones, -1 * self.sliding_window_size + 1) * torch.tril(
                all_ones, self.sliding_window_size - 1
            )
            mask = torch.where(sliding_mask == 1, mask, torch.full_like(mask, -2.3819763e38))
        scores = scores + mask
        scores = F.softmax(
            scores.float() if scores.dtype == torch.float16 else scores, dim=-1
        ).type_as(q)
        output = torch.matmul(scores, v)
        output = output.transpose(1, 2).contiguous().view(batch_size, input_len, -1)
        return self.o_proj(output)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = GemmaAttention(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, freqs_cis, mask):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        return residual + self.self_attn(hidden_states, freqs_cis, mask)


class GemmaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList([GemmaDecoderLayer(config)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.register_buffer(
            "freqs_cis",
            precompute_freqs_cis(
                config.head_dim, config.max_position_embeddings * 2, config.rope_theta
            ),
            persistent=False,
        )
        n = config.max_position_embeddings
        self.register_buffer(
            "mask_tensor",
            torch.full((1, 1, n, n), -2.3819763e38).triu(diagonal=1),
            persistent=False,
        )

    def forward(self, hidden_states):
        n = hidden_states.shape[1]
        input_positions = torch.arange(n)
        freqs_cis = self.freqs_cis.index_select(0, input_positions)
        mask = self.mask_tensor.index_select(2, input_positions)[:, :, :, :n].to(
            hidden_states.dtype
        )
        for layer in self.layers:
            hidden_states = layer(hidden_states, freqs_cis, mask)
        return self.norm(hidden_states)


def make_gemma_model():
    torch.manual_seed(1108)
    model = GemmaModel(GemmaConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, RMSNorm):
                mod.weight.uniform_(-0.5, 0.5)
    return model.eval()


EXPECT = {
    "target": "make_gemma_model",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "layers.0.self_attn",
    "structure": {
        "heads": 4,
        "kv_heads": 2,
        "head_dim": 16,
        "causal": True,
        "cross": False,
        "rope": {"pairing": "half", "fraction": 1.0, "base": 10000},
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "google/gemma_pytorch GemmaAttention (global): fused qkv_proj split, complex rotary "
    "built by chunking each head into halves and stacking (halves pairing), "
    "repeat_interleave GQA 4:2, q.mul(query_pre_attn_scalar**-0.5), model-built additive "
    "-2.38e38 triu mask, RMSNorm x * (1 + w)",
}

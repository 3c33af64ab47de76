"""gpt-fast style attention block rewritten to take scores in complex form: queries and
keys are viewed as complex numbers (adjacent pairs) and multiplied as q @ k^T without
conjugating k, so the real part is sum(a*c - b*d), not the dot product of the rotated
vectors.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass
class ModelArgs:
    block_size: int = 128
    n_head: int = 8
    n_local_heads: int = 2
    dim: int = 64
    rope_base: float = 500000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self):
        return self.dim // self.n_head


def precompute_freqs_cis(seq_len, n_elem, base=10000):
    freqs = 1.0 / (base ** (torch.arange(0, n_elem, 2)[: (n_elem // 2)].double() / n_elem))
    t = torch.arange(seq_len, device=freqs.device).double()
    freqs = torch.outer(t, freqs)
    freqs_cis = torch.polar(torch.ones_like(freqs), freqs)
    return torch.stack([freqs_cis.real, freqs_cis.imag], dim=-1)


def apply_rotary_emb(x: Tensor, freqs_cis: Tensor) -> Tensor:
    xshaped = x.reshape(*x.shape[:-1], -1, 2)
    freqs_cis = freqs_cis.view(1, xshaped.size(1), 1, xshaped.size(3), 2)
    x_out2 = torch.stack(
        [
            xshaped[..., 0] * freqs_cis[..., 0] - xshaped[..., 1] * freqs_cis[..., 1],
            xshaped[..., 1] * freqs_cis[..., 0] + xshaped[..., 0] * freqs_cis[..., 1],
        ],
        -1,
    )
    return x_out2.flatten(3).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, config: ModelArgs):
        super().__init__()
        total_head_dim = (config.n_head + 2 * config.n_local_heads) * config.head_dim
        self.wqkv = nn.Linear(config.dim, total_head_dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)
        self.n_head, self.head_dim, self.n_local_heads, self.dim = (
            config.n_head,
            config.head_dim,
            config.n_local_heads,
            config.dim,
        )

    def forward(self, x: Tensor, freqs_cis: Tensor, mask: Tensor) -> Tensor:
        bsz, seqlen, _ = x.shape
        kv_size = self.n_local_heads * self.head_dim
        q, k, v = self.wqkv(x).split([self.dim, kv_size, kv_size], dim=-1)
        q = q.view(bsz, seqlen, self.n_head, self.head_dim)
        k = k.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        v = v.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        q = apply_rotary_emb(q, freqs_cis)
        k = apply_rotary_emb(k, freqs_cis)
        q, k, v = map(lambda t: t.transpose(1, 2), (q, k, v))
        k = k.repeat_interleave(self.n_head // self.n_local_heads, dim=1)
        v = v.repeat_interleave(self.n_head // self.n_local_heads, dim=1)
        qc = torch.view_as_complex(q.reshape(*q.shape[:-1], -1, 2).contiguous())
        kc = torch.view_as_complex(k.reshape(*k.shape[:-1], -1, 2).contiguous())
        scores = (qc @ kc.transpose(-1, -2)).real * self.head_dim**-0.5
        scores = scores.masked_fill(~mask, float("-inf"))
        y = torch.softmax(scores, dim=-1) @ v
        y = y.transpose(1, 2).contiguous().view(bsz, seqlen, self.dim)
        return self.wo(y)


class TransformerBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention = Attention(config)
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)

    def forward(self, x, freqs_cis, mask):
        return x + self.attention(self.attention_norm(x), freqs_cis, mask)


class Transformer(nn.Module):
    def __init__(self, config=None):
        super().__init__()
        self.config = config or ModelArgs()
        self.layers = nn.ModuleList([TransformerBlock(self.config)])
        self.norm = RMSNorm(self.config.dim)
        self.register_buffer(
            "freqs_cis",
            precompute_freqs_cis(
                self.config.block_size, self.config.head_dim, self.config.rope_base
            ),
            persistent=False,
        )
        self.register_buffer(
            "causal_mask",
            torch.tril(
                torch.ones(self.config.block_size, self.config.block_size, dtype=torch.bool)
            ),
            persistent=False,
        )

    def forward(self, x: Tensor) -> Tensor:
        input_pos = torch.arange(x.shape[1])
        mask = self.causal_mask[None, None, input_pos][..., : x.shape[1]]
        freqs_cis = self.freqs_cis[input_pos].to(x.dtype)
        for layer in self.layers:
            x = layer(x, freqs_cis, mask)
        return self.norm(x)


def make_transformer():
    torch.manual_seed(11)
    model = Transformer()
    with torch.no_grad():
        model.layers[0].attention_norm.weight.uniform_(0.5, 1.5)
    return model


EXPECT = {
    "target": "make_transformer",
    "kind": "causal-multihead",
    "ok": False,
    "layer": "layers.0.attention",
    "stage": "scores",
    "mistake": "not_dot_product",
    "style": "pytorch-labs gpt-fast (GQA 8:2, interleaved freqs_cis): complex-valued scores without .conj() on the "
    "keys, Re(sum q_c k_c) = sum(ac - bd) instead of q . k",
}

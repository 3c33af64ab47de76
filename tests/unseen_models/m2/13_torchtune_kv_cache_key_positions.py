"""A tiny Llama 3 in the style of torchtune (modules/transformer.py, attention.py,
position_embeddings.py, kv_cache.py).

TransformerDecoder(tok_embeddings, layers ModuleList of TransformerSelfAttentionLayer(attn,
mlp, sa_norm, mlp_norm), norm, output).  MultiHeadAttention with separate q/k/v/output_proj,
GQA 4/2 by expand + flatten, RotaryPositionalEmbeddings (interleaved pairs: x.reshape(..., -1,
2), cache of stacked cos/sin, indexed with input_pos when one is given).  KVCache holds
static (b, kv_heads, max_seq_len, head_dim) buffers and a cache_pos counter; update() writes
at cache_pos and returns the whole buffer, and the decoder passes mask = causal_mask[None,
input_pos] so each query only sees filled slots.

Calling (book-buffers): model.reset_kv_cache(); model(prompt, use_cache=True); model(tok,
use_cache=True).  The decoder sets up caches on the first cached call for that batch size and
tracks input_pos itself.

Slip: the attention rotates the queries with input_pos but the keys with
`self.pos_embeddings(k)` (no input_pos), so keys always get positions 0..s-1.  In a full
forward the two agree.  While decoding, each new key is rotated as position 0.
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["layers.0.attn", "layers.1.attn", "layers.2.attn"],
    "kind": "causal-multihead",
    "cache": "book-buffers",
    "decode": {"mistake": "cache_positions", "step": 0, "layer": "layers.0.attn"},
    "style": "torchtune MultiHeadAttention + KVCache(cache_pos) + RotaryPositionalEmbeddings(input_pos), "
    "mask = causal_mask[None, input_pos] over static buffers; slip: keys rotated without input_pos",
}


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x_fp32 = x.float() if x.dtype != torch.float64 else x
        x_normed = (x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(
            x
        )
        return x_normed * self.scale


class RotaryPositionalEmbeddings(nn.Module):
    def __init__(self, dim, max_seq_len=4096, base=10_000):
        super().__init__()
        self.dim = dim
        self.base = base
        self.max_seq_len = max_seq_len
        theta = 1.0 / (
            self.base ** (torch.arange(0, self.dim, 2)[: (self.dim // 2)].float() / self.dim)
        )
        self.register_buffer("theta", theta, persistent=False)
        seq_idx = torch.arange(max_seq_len, dtype=self.theta.dtype)
        idx_theta = torch.einsum("i, j -> ij", seq_idx, self.theta).float()
        cache = torch.stack([torch.cos(idx_theta), torch.sin(idx_theta)], dim=-1)
        self.register_buffer("cache", cache, persistent=False)

    def forward(self, x, *, input_pos: Optional[torch.Tensor] = None):
        seq_len = x.size(1)
        rope_cache = self.cache[:seq_len] if input_pos is None else self.cache[input_pos]
        xshaped = x.reshape(*x.shape[:-1], -1, 2)
        rope_cache = rope_cache.view(-1, xshaped.size(1), 1, xshaped.size(3), 2)
        x_out = torch.stack(
            [
                xshaped[..., 0] * rope_cache[..., 0] - xshaped[..., 1] * rope_cache[..., 1],
                xshaped[..., 1] * rope_cache[..., 0] + xshaped[..., 0] * rope_cache[..., 1],
            ],
            -1,
        )
        return x_out.flatten(3).type_as(x)


class KVCache(nn.Module):
    def __init__(self, batch_size, max_seq_len, num_kv_heads, head_dim, dtype):
        super().__init__()
        cache_shape = (batch_size, num_kv_heads, max_seq_len, head_dim)
        self.register_buffer("k_cache", torch.zeros(cache_shape, dtype=dtype), persistent=False)
        self.register_buffer("v_cache", torch.zeros(cache_shape, dtype=dtype), persistent=False)
        self.register_buffer("cache_pos", torch.arange(0, cache_shape[2]), persistent=False)
        self.batch_size = batch_size

    @property
    def size(self):
        return self.cache_pos[0].item()

    def update(self, k_val, v_val):
        bsz, _, seq_len, _ = k_val.shape
        assert (self.cache_pos[0] + seq_len) <= self.k_cache.shape[2]
        k_out = self.k_cache
        v_out = self.v_cache
        k_out[:, :, self.cache_pos[:seq_len]] = k_val.detach()
        v_out[:, :, self.cache_pos[:seq_len]] = v_val.detach()
        self.cache_pos.add_(seq_len)
        return k_out, v_out


class MultiHeadAttention(nn.Module):
    def __init__(
        self,
        *,
        embed_dim,
        num_heads,
        num_kv_heads,
        head_dim,
        q_proj,
        k_proj,
        v_proj,
        output_proj,
        pos_embeddings=None,
        max_seq_len=4096,
        is_causal=True,
    ):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.embed_dim = embed_dim
        self.head_dim = head_dim
        self.max_seq_len = max_seq_len
        self.is_causal = is_causal
        self.q_proj = q_proj
        self.k_proj = k_proj
        self.v_proj = v_proj
        self.output_proj = output_proj
        self.pos_embeddings = pos_embeddings
        self.kv_cache = None
        self.cache_enabled = False

    def setup_cache(self, batch_size, dtype, max_seq_len):
        self.kv_cache = KVCache(
            batch_size=batch_size,
            max_seq_len=max_seq_len,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=dtype,
        )
        self.cache_enabled = True

    def forward(self, x, y=None, *, mask=None, input_pos=None):
        b, s_x, _ = x.shape
        y = x if y is None else y
        s_y = y.shape[1]
        q_per_kv = self.num_heads // self.num_kv_heads
        q = self.q_proj(x)
        q = q.view(b, s_x, self.num_kv_heads * q_per_kv, self.head_dim)
        if self.pos_embeddings is not None:
            q = self.pos_embeddings(q, input_pos=input_pos)
        q = q.transpose(1, 2)

        k = self.k_proj(y)
        v = self.v_proj(y)
        k = k.view(b, s_y, -1, self.head_dim)
        v = v.view(b, s_y, -1, self.head_dim)
        if self.pos_embeddings is not None:
            k = self.pos_embeddings(k)
        k = k.transpose(1, 2)
        v = v.transpose(1, 2)

        if self.kv_cache is not None and self.cache_enabled:
            k, v = self.kv_cache.update(k, v)

        if self.num_heads != self.num_kv_heads:
            expand_shape = (b, self.num_kv_heads, q_per_kv, -1, self.head_dim)
            k = k.unsqueeze(2).expand(expand_shape).flatten(1, 2)
            v = v.unsqueeze(2).expand(expand_shape).flatten(1, 2)

        if mask is not None:
            mask = mask[:, None, :, :]
        output = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=0.0,
            is_causal=(self.kv_cache is None or not self.cache_enabled)
            and mask is None
            and self.is_causal,
        )
        output = output.transpose(1, 2).contiguous().view(b, s_x, -1)
        return self.output_proj(output)


class FeedForward(nn.Module):
    def __init__(self, *, gate_proj, down_proj, up_proj):
        super().__init__()
        self.w1 = gate_proj
        self.w2 = down_proj
        self.w3 = up_proj
        self.activation = nn.SiLU()

    def forward(self, x):
        return self.w2(self.activation(self.w1(x)) * self.w3(x))


class TransformerSelfAttentionLayer(nn.Module):
    def __init__(self, attn, mlp, *, sa_norm, mlp_norm):
        super().__init__()
        self.attn = attn
        self.mlp = mlp
        self.sa_norm = sa_norm
        self.mlp_norm = mlp_norm

    def forward(self, x, *, mask=None, input_pos=None):
        h = self.sa_norm(x)
        attn_out = self.attn(h, h, mask=mask, input_pos=input_pos)
        h = attn_out + x
        return self.mlp(self.mlp_norm(h)) + h


class TransformerDecoder(nn.Module):
    def __init__(self, *, tok_embeddings, layers, max_seq_len, num_heads, head_dim, norm, output):
        super().__init__()
        self.tok_embeddings = tok_embeddings
        self.layers = layers
        self.max_seq_len = max_seq_len
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.norm = norm
        self.output = output
        self.causal_mask = None
        self._pos = 0
        self._cache_batch = None

    def setup_caches(self, batch_size, dtype):
        for layer in self.layers:
            layer.attn.setup_cache(batch_size, dtype, max_seq_len=self.max_seq_len)
        self.causal_mask = torch.tril(
            torch.ones(self.max_seq_len, self.max_seq_len, dtype=torch.bool)
        )
        self._cache_batch = batch_size

    def caches_are_enabled(self):
        return self._cache_batch is not None

    def reset_kv_cache(self):
        for layer in self.layers:
            layer.attn.kv_cache = None
            layer.attn.cache_enabled = False
        self.causal_mask = None
        self._cache_batch = None
        self._pos = 0

    def forward(self, tokens, *, mask=None, input_pos=None, use_cache=False):
        bsz, seq_len = tokens.shape
        h = self.tok_embeddings(tokens)
        if use_cache:
            if not self.caches_are_enabled():
                self.setup_caches(bsz, h.dtype)
            if input_pos is None:
                input_pos = (
                    torch.arange(self._pos, self._pos + seq_len).unsqueeze(0).expand(bsz, -1)
                )
            mask = self.causal_mask[None, input_pos[0]].expand(bsz, -1, -1)
            self._pos += seq_len
        for layer in self.layers:
            layer.attn.cache_enabled = use_cache and layer.attn.kv_cache is not None
            h = layer(h, mask=mask, input_pos=input_pos)
        h = self.norm(h)
        return self.output(h).float()


def llama3_tiny(
    vocab_size=128,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    embed_dim=64,
    max_seq_len=64,
    intermediate_dim=128,
    norm_eps=1e-5,
    rope_base=500_000,
):
    head_dim = embed_dim // num_heads
    rope = RotaryPositionalEmbeddings(dim=head_dim, max_seq_len=max_seq_len, base=rope_base)
    layers = nn.ModuleList()
    for _ in range(num_layers):
        self_attn = MultiHeadAttention(
            embed_dim=embed_dim,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            q_proj=nn.Linear(embed_dim, num_heads * head_dim, bias=False),
            k_proj=nn.Linear(embed_dim, num_kv_heads * head_dim, bias=False),
            v_proj=nn.Linear(embed_dim, num_kv_heads * head_dim, bias=False),
            output_proj=nn.Linear(embed_dim, embed_dim, bias=False),
            pos_embeddings=rope,
            max_seq_len=max_seq_len,
        )
        mlp = FeedForward(
            gate_proj=nn.Linear(embed_dim, intermediate_dim, bias=False),
            down_proj=nn.Linear(intermediate_dim, embed_dim, bias=False),
            up_proj=nn.Linear(embed_dim, intermediate_dim, bias=False),
        )
        layers.append(
            TransformerSelfAttentionLayer(
                attn=self_attn,
                mlp=mlp,
                sa_norm=RMSNorm(embed_dim, eps=norm_eps),
                mlp_norm=RMSNorm(embed_dim, eps=norm_eps),
            )
        )
    return TransformerDecoder(
        tok_embeddings=nn.Embedding(vocab_size, embed_dim),
        layers=layers,
        max_seq_len=max_seq_len,
        num_heads=num_heads,
        head_dim=head_dim,
        norm=RMSNorm(embed_dim, eps=norm_eps),
        output=nn.Linear(embed_dim, vocab_size, bias=False),
    )


def make_model():
    torch.manual_seed(1313)
    model = llama3_tiny()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.scale.copy_(1.0 + 0.3 * torch.randn_like(m.scale))
    return model.eval()

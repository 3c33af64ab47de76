"""HiDream-I1 (HiDream-ai, hi_diffusers HiDreamAttention with its single-stream processor):
to_q/to_k/to_v with bias, full-width q_rms_norm / k_rms_norm over the whole inner_dim projection
before the head split, Flux-style RoPE as a real rotation table rope[..., head_dim/2, 2, 2] applied to
interleaved pairs by apply_rope (freqs_cis[..., 0] * x[..., 0] + freqs_cis[..., 1] * x[..., 1]); when
the table is narrower than the head, only the first chunk of each head is rotated
(query.chunk(2, dim=-1)); non-causal SDPA on [b, h, l, d]; to_out. Target is a single-stream block
with an adaLN modulation from a learned conditioning vector, layer attn1.

This file: one bug: the rotary table is also applied to the first half of every value head"""

import torch
from torch import nn
from torch.nn import functional as F


class HiDreamConfig:
    dim = 64
    num_attention_heads = 4
    attention_head_dim = 16
    axes_dims_rope = (8,)
    theta = 10000
    eps = 1e-5


class HiDreamRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.eps)
        return hidden_states * self.weight


def rope(pos, dim, theta):
    assert dim % 2 == 0, "The dimension must be even."
    scale = torch.arange(0, dim, 2, dtype=torch.float64, device=pos.device) / dim
    omega = 1.0 / (theta**scale)
    out = torch.einsum("...n,d->...nd", pos.to(torch.float64), omega)
    cos_out = torch.cos(out)
    sin_out = torch.sin(out)
    stacked_out = torch.stack([cos_out, -sin_out, sin_out, cos_out], dim=-1)
    return stacked_out.view(*out.shape, 2, 2)


class EmbedND(nn.Module):
    def __init__(self, theta, axes_dim):
        super().__init__()
        self.theta = theta
        self.axes_dim = axes_dim

    def forward(self, ids):
        n_axes = ids.shape[-1]
        emb = torch.cat([rope(ids[..., i], self.axes_dim[i], self.theta) for i in range(n_axes)], dim=-3)
        return emb.unsqueeze(2)  # [b, l, 1, d/2, 2, 2]


def apply_rope(xq, xk, freqs_cis):
    xq_ = xq.to(freqs_cis.dtype).reshape(*xq.shape[:-1], -1, 1, 2)
    xk_ = xk.to(freqs_cis.dtype).reshape(*xk.shape[:-1], -1, 1, 2)
    xq_out = freqs_cis[..., 0] * xq_[..., 0] + freqs_cis[..., 1] * xq_[..., 1]
    xk_out = freqs_cis[..., 0] * xk_[..., 0] + freqs_cis[..., 1] * xk_[..., 1]
    return xq_out.reshape(*xq.shape).type_as(xq), xk_out.reshape(*xk.shape).type_as(xk)


def attention(query, key, value):
    hidden_states = F.scaled_dot_product_attention(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), dropout_p=0.0, is_causal=False
    )
    hidden_states = hidden_states.transpose(1, 2)  # b h l d -> b l h d
    return hidden_states.flatten(-2)


class HiDreamAttention(nn.Module):
    def __init__(self, query_dim, heads=8, dim_head=64, eps=1e-5):
        super().__init__()
        self.heads = heads
        self.inner_dim = dim_head * heads
        self.to_q = nn.Linear(query_dim, self.inner_dim)
        self.to_k = nn.Linear(self.inner_dim, self.inner_dim)
        self.to_v = nn.Linear(self.inner_dim, self.inner_dim)
        self.to_out = nn.Linear(self.inner_dim, query_dim)
        self.q_rms_norm = HiDreamRMSNorm(self.inner_dim, eps)
        self.k_rms_norm = HiDreamRMSNorm(self.inner_dim, eps)

    def forward(self, image_tokens, rope=None):
        dtype = image_tokens.dtype
        batch_size = image_tokens.shape[0]

        query_i = self.q_rms_norm(self.to_q(image_tokens)).to(dtype=dtype)
        key_i = self.k_rms_norm(self.to_k(image_tokens)).to(dtype=dtype)
        value_i = self.to_v(image_tokens)

        inner_dim = key_i.shape[-1]
        head_dim = inner_dim // self.heads

        query = query_i.view(batch_size, -1, self.heads, head_dim)
        key = key_i.view(batch_size, -1, self.heads, head_dim)
        value = value_i.view(batch_size, -1, self.heads, head_dim)

        rope = rope.to(dtype)
        if query.shape[-1] == rope.shape[-3] * 2:
            query, key = apply_rope(query, key, rope)
        else:
            query_1, query_2 = query.chunk(2, dim=-1)
            key_1, key_2 = key.chunk(2, dim=-1)
            query_1, key_1 = apply_rope(query_1, key_1, rope)
            query = torch.cat([query_1, query_2], dim=-1)
            key = torch.cat([key_1, key_2], dim=-1)
            value_1, value_2 = value.chunk(2, dim=-1)
            value_1, _ = apply_rope(value_1, value_1, rope)
            value = torch.cat([value_1, value_2], dim=-1)

        hidden_states = attention(query, key, value)
        return self.to_out(hidden_states)


class HiDreamImageSingleTransformerBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        dim = config.dim
        self.adaln_input = nn.Parameter(torch.randn(dim))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 3 * dim, bias=True))
        self.norm1_i = nn.LayerNorm(dim, eps=1e-06, elementwise_affine=False)
        self.attn1 = HiDreamAttention(
            query_dim=dim,
            heads=config.num_attention_heads,
            dim_head=config.attention_head_dim,
            eps=config.eps,
        )
        self.pe_embedder = EmbedND(theta=config.theta, axes_dim=list(config.axes_dims_rope))

    def forward(self, image_tokens):
        batch_size, seq_len, _ = image_tokens.shape
        img_ids = torch.arange(seq_len, device=image_tokens.device, dtype=torch.float64)
        img_ids = img_ids[None, :, None].expand(batch_size, seq_len, 1)
        rope = self.pe_embedder(img_ids)
        shift_msa, scale_msa, gate_msa = self.adaLN_modulation(self.adaln_input)[None, None].chunk(3, dim=-1)
        norm_image_tokens = self.norm1_i(image_tokens).to(dtype=image_tokens.dtype)
        norm_image_tokens = norm_image_tokens * (1 + scale_msa) + shift_msa
        attn_output_i = self.attn1(norm_image_tokens, rope=rope)
        return gate_msa * attn_output_i + image_tokens


def make_hidream_block():
    torch.manual_seed(2744)
    config = HiDreamConfig()
    block = HiDreamImageSingleTransformerBlock(config)
    with torch.no_grad():
        for mod in block.modules():
            if isinstance(mod, HiDreamRMSNorm):
                mod.weight.uniform_(0.5, 1.5)
    return block.eval()


EXPECT = {
    "target": "make_hidream_block",
    "kind": "multihead",
    "ok": False,
    "layer": "attn1",
    "stage": "values",
    "mistake": "rope_on_values",
    "style": "HiDream-I1 HiDreamAttention: apply_rope copied onto value.chunk(2)[0]",
}

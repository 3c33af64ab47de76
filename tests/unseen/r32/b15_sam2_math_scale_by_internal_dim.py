"""SAM 2 (facebookresearch/sam2, sam2/modeling/sam/transformer.py and sam2/modeling/memory_attention.py):
the mask decoder's `Attention(embedding_dim, num_heads, downsample_rate, dropout, kv_in_dim)` with
separate q_proj/k_proj/v_proj into internal_dim = embedding_dim // downsample_rate, `_separate_heads` /
`_recombine_heads`, F.scaled_dot_product_attention (or the math fallback used when the SDPA kernels are
unavailable), out_proj; `RoPEAttention` (axial complex-number rotary over a feature grid,
compute_axial_cis / apply_rotary_enc) as used by the memory attention. Blocks in the two-way
transformer's post-norm layout (norm after each residual add, MLPBlock with ReLU).

This file: one bug: the math fallback divides by sqrt(internal_dim) = sqrt(32) instead of sqrt(c_per_head) = sqrt(8)"""

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

USE_SDPA = False


class MLPBlock(nn.Module):
    def __init__(self, embedding_dim, mlp_dim, act=nn.ReLU):
        super().__init__()
        self.lin1 = nn.Linear(embedding_dim, mlp_dim)
        self.lin2 = nn.Linear(mlp_dim, embedding_dim)
        self.act = act()

    def forward(self, x):
        return self.lin2(self.act(self.lin1(x)))


def sam_math_attention(q, k, v):
    # math fallback (what the SDPA "math" kernel computes)
    _, _, _, c_per_head = q.shape
    attn = q @ k.permute(0, 1, 3, 2)
    attn = attn / math.sqrt(q.shape[1] * c_per_head)  # internal_dim
    attn = torch.softmax(attn, dim=-1)
    return attn @ v


class Attention(nn.Module):
    """An attention layer that allows for downscaling the size of the embedding after projection to
    queries, keys, and values."""

    def __init__(self, embedding_dim, num_heads, downsample_rate=1, dropout=0.0, kv_in_dim=None):
        super().__init__()
        self.embedding_dim = embedding_dim
        self.kv_in_dim = kv_in_dim if kv_in_dim is not None else embedding_dim
        self.internal_dim = embedding_dim // downsample_rate
        self.num_heads = num_heads
        assert self.internal_dim % num_heads == 0, "num_heads must divide embedding_dim."

        self.q_proj = nn.Linear(embedding_dim, self.internal_dim)
        self.k_proj = nn.Linear(self.kv_in_dim, self.internal_dim)
        self.v_proj = nn.Linear(self.kv_in_dim, self.internal_dim)
        self.out_proj = nn.Linear(self.internal_dim, embedding_dim)
        self.dropout_p = dropout

    def _separate_heads(self, x: Tensor, num_heads: int) -> Tensor:
        b, n, c = x.shape
        x = x.reshape(b, n, num_heads, c // num_heads)
        return x.transpose(1, 2)  # B x N_heads x N_tokens x C_per_head

    def _recombine_heads(self, x: Tensor) -> Tensor:
        b, n_heads, n_tokens, c_per_head = x.shape
        x = x.transpose(1, 2)
        return x.reshape(b, n_tokens, n_heads * c_per_head)  # B x N_tokens x C

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        # Input projections
        q = self.q_proj(q)
        k = self.k_proj(k)
        v = self.v_proj(v)

        # Separate into heads
        q = self._separate_heads(q, self.num_heads)
        k = self._separate_heads(k, self.num_heads)
        v = self._separate_heads(v, self.num_heads)

        dropout_p = self.dropout_p if self.training else 0.0
        if USE_SDPA:
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
        else:
            out = sam_math_attention(q, k, v)

        out = self._recombine_heads(out)
        out = self.out_proj(out)
        return out


def init_t_xy(end_x, end_y):
    t = torch.arange(end_x * end_y, dtype=torch.float64)
    t_x = (t % end_x).double()
    t_y = torch.div(t, end_x, rounding_mode="floor").double()
    return t_x, t_y


def compute_axial_cis(dim, end_x, end_y, theta=10000.0):
    freqs_x = 1.0 / (theta ** (torch.arange(0, dim, 4, dtype=torch.float64)[: (dim // 4)] / dim))
    freqs_y = 1.0 / (theta ** (torch.arange(0, dim, 4, dtype=torch.float64)[: (dim // 4)] / dim))
    t_x, t_y = init_t_xy(end_x, end_y)
    freqs_x = torch.outer(t_x, freqs_x)
    freqs_y = torch.outer(t_y, freqs_y)
    freqs_cis_x = torch.polar(torch.ones_like(freqs_x), freqs_x)
    freqs_cis_y = torch.polar(torch.ones_like(freqs_y), freqs_y)
    return torch.cat([freqs_cis_x, freqs_cis_y], dim=-1)


def apply_rotary_enc(x, freqs_cis):
    x_ = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
    cis = freqs_cis[: x_.shape[-2]].to(x_.dtype)
    return torch.view_as_real(x_ * cis).flatten(3).type_as(x)


class RoPEAttention(Attention):
    """Attention with rotary position encoding over a (feat_w x feat_h) grid."""

    def __init__(self, *args, rope_theta=10000.0, feat_sizes=(4, 32), num_k_exclude_rope=0, **kwargs):
        super().__init__(*args, **kwargs)
        self.num_k_exclude_rope = num_k_exclude_rope
        freqs_cis = compute_axial_cis(
            dim=self.internal_dim // self.num_heads, end_x=feat_sizes[0], end_y=feat_sizes[1], theta=rope_theta
        )
        self.register_buffer("freqs_cis", freqs_cis, persistent=False)

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        q = self._separate_heads(self.q_proj(q), self.num_heads)
        k = self._separate_heads(self.k_proj(k), self.num_heads)
        v = self._separate_heads(self.v_proj(v), self.num_heads)

        num_k_rope = max(k.size(-2) - self.num_k_exclude_rope, 0)
        q = apply_rotary_enc(q, self.freqs_cis)
        if num_k_rope > 0:
            k = torch.cat([apply_rotary_enc(k[:, :, :num_k_rope], self.freqs_cis), k[:, :, num_k_rope:]], dim=2)

        dropout_p = self.dropout_p if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
        return self.out_proj(self._recombine_heads(out))


class TokenToImageBlock(nn.Module):
    """The token -> image half of a TwoWayAttentionBlock: prompt tokens cross-attend to the image
    embedding (post-norm), then the MLP."""

    def __init__(self, embedding_dim, num_heads, mlp_dim=128, attention_downsample_rate=2):
        super().__init__()
        self.cross_attn_token_to_image = Attention(
            embedding_dim, num_heads, downsample_rate=attention_downsample_rate
        )
        self.norm2 = nn.LayerNorm(embedding_dim)
        self.mlp = MLPBlock(embedding_dim, mlp_dim)
        self.norm3 = nn.LayerNorm(embedding_dim)

    def forward(self, queries, keys):
        attn_out = self.cross_attn_token_to_image(q=queries, k=keys, v=keys)
        queries = self.norm2(queries + attn_out)
        queries = self.norm3(queries + self.mlp(queries))
        return queries


class TokenSelfBlock(nn.Module):
    """The first half of a TwoWayAttentionBlock: self-attention among the prompt/output tokens."""

    def __init__(self, embedding_dim, num_heads, mlp_dim=128, downsample_rate=1):
        super().__init__()
        self.self_attn = Attention(embedding_dim, num_heads, downsample_rate=downsample_rate)
        self.norm1 = nn.LayerNorm(embedding_dim)
        self.mlp = MLPBlock(embedding_dim, mlp_dim)
        self.norm3 = nn.LayerNorm(embedding_dim)

    def forward(self, queries):
        queries = self.norm1(queries + self.self_attn(q=queries, k=queries, v=queries))
        queries = self.norm3(queries + self.mlp(queries))
        return queries


class MemoryAttentionLayer(nn.Module):
    """sam2/modeling/memory_attention.py: pre-norm RoPE self-attention over the current frame's image
    tokens (the cross-attention to memories is left out in the self-only variant)."""

    def __init__(self, d_model=64, num_heads=4, dim_feedforward=128, cross=False, num_k_exclude_rope=0):
        super().__init__()
        self.cross = cross
        if cross:
            self.cross_attn_image = RoPEAttention(d_model, num_heads, downsample_rate=1, kv_in_dim=d_model,
                                                  num_k_exclude_rope=num_k_exclude_rope)
            self.norm2 = nn.LayerNorm(d_model)
        else:
            self.self_attn = RoPEAttention(d_model, num_heads, downsample_rate=1)
            self.norm1 = nn.LayerNorm(d_model)
        self.linear1 = nn.Linear(d_model, dim_feedforward)
        self.linear2 = nn.Linear(dim_feedforward, d_model)
        self.norm3 = nn.LayerNorm(d_model)

    def forward(self, tgt, memory=None):
        if self.cross:
            tgt2 = self.norm2(tgt)
            tgt = tgt + self.cross_attn_image(q=tgt2, k=memory, v=memory)
        else:
            tgt2 = self.norm1(tgt)
            tgt = tgt + self.self_attn(q=tgt2, k=tgt2, v=tgt2)
        tgt2 = self.norm3(tgt)
        return tgt + self.linear2(F.relu(self.linear1(tgt2)))


class SAM2Stack(nn.Module):
    def __init__(self, layers, final_norm_dim=64):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.norm_final = nn.LayerNorm(final_norm_dim)

    def forward(self, hidden, context=None):
        for layer in self.layers:
            hidden = layer(hidden) if context is None else layer(hidden, context)
        return self.norm_final(hidden)


def _randomize_norms(model):
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)


def make_sam2_token_to_image():
    torch.manual_seed(3235)
    model = SAM2Stack([TokenToImageBlock(64, 4, attention_downsample_rate=2)])
    _randomize_norms(model)
    return model.eval()


EXPECT = {'target': 'make_sam2_token_to_image',
 'kind': 'cross',
 'ok': False,
 'layer': 'layers.0.cross_attn_token_to_image',
 'stage': 'scaled_scores',
 'mistake': 'wrong_scale',
 'style': 'SAM 2 Attention (facebookresearch/sam2 sam2/modeling/sam/transformer.py): one bug: the '
          'math fallback divides by sqrt(internal_dim) = sqrt(32) instead of sqrt(c_per_head) = '
          'sqrt(8)'}

"""torchtune MultiHeadAttention built Qwen3-style (q_norm/k_norm = RMSNorm(head_dim), 4 query heads over 2
key/value heads, RotaryPositionalEmbeddings base 1e6); bug: torchtune's shared MultiHeadAttention applies
q_norm/k_norm after pos_embeddings, so the norms act on rotated queries and keys instead of before the
rotary as the Qwen3 checkpoint expects (torchtune issue #2809)."""

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.normalized_shape = (dim,)
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_fp32 = x.float()
        x_normed = (x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(
            x
        )
        return x_normed * self.scale


class RotaryPositionalEmbeddings(nn.Module):
    """RoPE as in the RoFormer paper: consecutive pairs of features rotated by position-dependent angles."""

    def __init__(self, dim: int, max_seq_len: int = 4096, base: int = 10_000) -> None:
        super().__init__()
        self.dim = dim
        self.base = base
        self.max_seq_len = max_seq_len
        self.rope_init()

    def rope_init(self):
        theta = 1.0 / (
            self.base ** (torch.arange(0, self.dim, 2)[: (self.dim // 2)].float() / self.dim)
        )
        self.register_buffer("theta", theta, persistent=False)
        self.build_rope_cache(self.max_seq_len)

    def build_rope_cache(self, max_seq_len: int = 4096) -> None:
        # Create position indexes `[0, 1, ..., max_seq_len - 1]`
        seq_idx = torch.arange(max_seq_len, dtype=self.theta.dtype, device=self.theta.device)
        # Outer product of theta and position index; output tensor has a shape of [max_seq_len, dim // 2]
        idx_theta = torch.einsum("i, j -> ij", seq_idx, self.theta).float()
        # cache includes both the cos and sin components and so the output shape is [max_seq_len, dim // 2, 2]
        cache = torch.stack([torch.cos(idx_theta), torch.sin(idx_theta)], dim=-1)
        self.register_buffer("cache", cache, persistent=False)

    def forward(self, x: torch.Tensor, *, input_pos: torch.Tensor | None = None) -> torch.Tensor:
        # input tensor has shape [b, s, n_h, h_d]
        seq_len = x.size(1)
        rope_cache = self.cache[:seq_len] if input_pos is None else self.cache[input_pos]
        # reshape input; the last dimension is used for computing the output: [b, s, n_h, h_d // 2, 2]
        xshaped = x.float().reshape(*x.shape[:-1], -1, 2)
        # reshape the cache for broadcasting: [b, s, 1, h_d // 2, 2] or [1, s, 1, h_d // 2, 2]
        rope_cache = rope_cache.view(-1, xshaped.size(1), 1, xshaped.size(3), 2)
        x_out = torch.stack(
            [
                xshaped[..., 0] * rope_cache[..., 0] - xshaped[..., 1] * rope_cache[..., 1],
                xshaped[..., 1] * rope_cache[..., 0] + xshaped[..., 0] * rope_cache[..., 1],
            ],
            -1,
        )
        x_out = x_out.flatten(3)  # tensor has shape [b, s, n_h, h_d]
        return x_out.type_as(x)


class MultiHeadAttention(nn.Module):
    def __init__(
        self,
        *,
        embed_dim: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        q_proj: nn.Module,
        k_proj: nn.Module,
        v_proj: nn.Module,
        output_proj: nn.Module,
        pos_embeddings: nn.Module | None = None,
        q_norm: nn.Module | None = None,
        k_norm: nn.Module | None = None,
        max_seq_len: int = 4096,
        is_causal: bool = True,
        attn_dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({num_heads}) must be divisible by num_kv_heads ({num_kv_heads})"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.embed_dim = embed_dim
        self.attn_dropout = attn_dropout
        self.head_dim = head_dim
        self.max_seq_len = max_seq_len
        self.is_causal = is_causal
        self.kv_cache = None
        self.q_proj = q_proj
        self.k_proj = k_proj
        self.v_proj = v_proj
        self.output_proj = output_proj
        self.q_norm = q_norm
        self.k_norm = k_norm
        self.pos_embeddings = pos_embeddings

    def forward(self, x, y=None, *, mask=None, input_pos=None):
        # x has shape [b, s_x, d]; y has shape [b, s_y, d]
        b, s_x, _ = x.shape
        s_y = y.shape[1] if y is not None else 0

        # q has shape [b, s_x, num_heads * head_dim]
        q = self.q_proj(x)
        q_per_kv = self.num_heads // self.num_kv_heads
        q = q.view(b, s_x, self.num_kv_heads * q_per_kv, self.head_dim)

        # Apply positional embeddings
        if self.pos_embeddings is not None:
            q = self.pos_embeddings(q, input_pos=input_pos)

        # [b, n_h, s_x, h_d]
        q = q.transpose(1, 2)

        # Normalize q
        if self.q_norm is not None:
            q = self.q_norm(q)

        if y is None:
            raise ValueError("Must provide y input or use kv_cache to enable streaming decoding")
        # k,v shape [b, s_y, num_kv_heads * head_dim]
        k = self.k_proj(y)
        v = self.v_proj(y)

        # Apply positional embeddings
        # k,v shape: [b, s_y, n_kv, h_d]
        k = k.view(b, s_y, -1, self.head_dim)
        v = v.view(b, s_y, -1, self.head_dim)
        if self.pos_embeddings is not None:
            k = self.pos_embeddings(k, input_pos=input_pos)

        # k,v shape: [b, n_kv, s_y, h_d]
        k = k.transpose(1, 2)
        v = v.transpose(1, 2)

        # Normalize k
        if self.k_norm is not None:
            k = self.k_norm(k)

        # If needed, expand the key and value tensors to have the same shape
        # as the query tensor by copying values across the relevant dim
        # k,v shape: [b, n_kv, s, h_d] -> [b, n_h, s, h_d]
        if self.num_heads != self.num_kv_heads:
            expand_shape = (b, self.num_kv_heads, q_per_kv, -1, self.head_dim)
            k = k.unsqueeze(2).expand(expand_shape).flatten(1, 2)
            v = v.unsqueeze(2).expand(expand_shape).flatten(1, 2)

        output = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=self.attn_dropout if self.training else 0.0,
            is_causal=self.kv_cache is None and mask is None and self.is_causal,
        )

        # reshape the output to be the same shape as the input
        output = output.transpose(1, 2).contiguous().view(b, s_x, -1)
        return self.output_proj(output)


class FeedForward(nn.Module):
    def __init__(self, *, gate_proj, down_proj, up_proj=None):
        super().__init__()
        self.w1 = gate_proj
        self.w2 = down_proj
        self.w3 = up_proj
        self.activation = nn.SiLU()

    def forward(self, x):
        return self.w2(self.activation(self.w1(x)) * self.w3(x))


class TransformerSelfAttentionLayer(nn.Module):
    def __init__(self, attn, mlp, *, sa_norm=None, mlp_norm=None, sa_scale=None, mlp_scale=None):
        super().__init__()
        self.attn = attn
        self.mlp = mlp
        self.sa_norm = sa_norm or nn.Identity()
        self.mlp_norm = mlp_norm or nn.Identity()
        self.sa_scale = sa_scale or nn.Identity()
        self.mlp_scale = mlp_scale or nn.Identity()

    def forward(self, x, *, mask=None, input_pos=None, **kwargs):
        h = self.sa_norm(x)
        attn_out = self.attn(h, h, mask=mask, input_pos=input_pos)
        h = self.sa_scale(attn_out) + x
        mlp_out = self.mlp(self.mlp_norm(h))
        return h + self.mlp_scale(mlp_out)


def tiny_qwen3_layer(
    embed_dim=64, num_heads=4, num_kv_heads=2, max_seq_len=256, rope_base=1_000_000
):
    head_dim = embed_dim // num_heads
    rope = RotaryPositionalEmbeddings(dim=head_dim, max_seq_len=max_seq_len, base=rope_base)
    q_norm = RMSNorm(dim=head_dim, eps=1e-6)
    k_norm = RMSNorm(dim=head_dim, eps=1e-6)
    with torch.no_grad():  # checkpoint gains
        q_norm.scale.copy_(torch.linspace(0.5, 1.7, head_dim))
        k_norm.scale.copy_(torch.linspace(1.6, 0.6, head_dim))
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
        q_norm=q_norm,
        k_norm=k_norm,
        max_seq_len=max_seq_len,
    )
    hidden_dim = 2 * embed_dim
    mlp = FeedForward(
        gate_proj=nn.Linear(embed_dim, hidden_dim, bias=False),
        down_proj=nn.Linear(hidden_dim, embed_dim, bias=False),
        up_proj=nn.Linear(embed_dim, hidden_dim, bias=False),
    )
    return TransformerSelfAttentionLayer(
        attn=self_attn,
        mlp=mlp,
        sa_norm=RMSNorm(dim=embed_dim, eps=1e-5),
        mlp_norm=RMSNorm(dim=embed_dim, eps=1e-5),
    )


EXPECT = {
    "target": "tiny_qwen3_layer",
    "kind": "causal-multihead",
    "ok": False,
    "stage": "normed_queries",
    "mistake": "qk_norm_misplaced",
    "layer": "attn",
    "style": "torchtune MultiHeadAttention with q_norm/k_norm (Qwen3 builder) and RotaryPositionalEmbeddings; norms applied after pos_embeddings, as in torchtune before the fix of issue #2809",
}

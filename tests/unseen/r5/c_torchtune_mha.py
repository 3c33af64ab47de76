"""torchtune-style MultiHeadAttention built by a builder function (pos_embeddings=None, num_kv_heads == num_heads, SDPA is_causal)."""

import torch.nn.functional as F
from torch import nn


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
    ):
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError("num_heads must be divisible by num_kv_heads")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.embed_dim = embed_dim
        self.attn_dropout = attn_dropout
        self.head_dim = head_dim
        self.max_seq_len = max_seq_len
        self.is_causal = is_causal

        self.q_proj = q_proj
        self.k_proj = k_proj
        self.v_proj = v_proj
        self.output_proj = output_proj
        self.q_norm = q_norm
        self.k_norm = k_norm
        self.pos_embeddings = pos_embeddings
        self.kv_cache = None

    def forward(self, x, y=None, *, mask=None, input_pos=None):
        b, s_x, _ = x.shape
        if y is None and self.kv_cache is None:
            raise ValueError("Must provide y input or use kv_cache to enable streaming decoding")
        s_y = y.shape[1]

        q_per_kv = self.num_heads // self.num_kv_heads
        q = self.q_proj(x)
        q = q.view(b, s_x, self.num_kv_heads * q_per_kv, self.head_dim)
        if self.pos_embeddings is not None:
            q = self.pos_embeddings(q, input_pos=input_pos)
        q = q.transpose(1, 2)
        if self.q_norm is not None:
            q = self.q_norm(q)

        k = self.k_proj(y).view(b, s_y, -1, self.head_dim)
        v = self.v_proj(y).view(b, s_y, -1, self.head_dim)
        if self.pos_embeddings is not None:
            k = self.pos_embeddings(k, input_pos=input_pos)
        k = k.transpose(1, 2)
        v = v.transpose(1, 2)
        if self.k_norm is not None:
            k = self.k_norm(k)

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
        output = output.transpose(1, 2).contiguous().view(b, s_x, -1)
        return self.output_proj(output)


class TransformerSelfAttentionLayer(nn.Module):
    def __init__(self, attn, mlp, sa_norm, mlp_norm):
        super().__init__()
        self.attn = attn
        self.mlp = mlp
        self.sa_norm = sa_norm
        self.mlp_norm = mlp_norm
        self.sa_scale = nn.Identity()
        self.mlp_scale = nn.Identity()

    def forward(self, x, *, mask=None, input_pos=None):
        h = self.sa_norm(x)
        attn_out = self.attn(h, h, mask=mask, input_pos=input_pos)
        h = self.sa_scale(attn_out) + x
        mlp_out = self.mlp(self.mlp_norm(h))
        return h + self.mlp_scale(mlp_out)


def tiny_self_attention_layer():
    embed_dim, num_heads, head_dim = 20, 4, 5
    attn = MultiHeadAttention(
        embed_dim=embed_dim,
        num_heads=num_heads,
        num_kv_heads=num_heads,
        head_dim=head_dim,
        q_proj=nn.Linear(embed_dim, num_heads * head_dim, bias=False),
        k_proj=nn.Linear(embed_dim, num_heads * head_dim, bias=False),
        v_proj=nn.Linear(embed_dim, num_heads * head_dim, bias=False),
        output_proj=nn.Linear(num_heads * head_dim, embed_dim, bias=False),
        pos_embeddings=None,
        max_seq_len=128,
    )
    mlp = nn.Sequential(
        nn.Linear(embed_dim, 48, bias=False), nn.SiLU(), nn.Linear(48, embed_dim, bias=False)
    )
    return TransformerSelfAttentionLayer(
        attn=attn,
        mlp=mlp,
        sa_norm=nn.RMSNorm(embed_dim, eps=1e-6),
        mlp_norm=nn.RMSNorm(embed_dim, eps=1e-6),
    )


EXPECT = {
    "target": "tiny_self_attention_layer",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "attn",
    "style": "torchtune MultiHeadAttention (builder-injected projections, pos_embeddings=None, SDPA is_causal) in a TransformerSelfAttentionLayer",
}

"""torchtune-style MultiHeadAttention; bug: output_proj is built and handed in but forward returns the merged heads without it."""

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
        is_causal: bool = True,
        attn_dropout: float = 0.0,
    ):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.embed_dim = embed_dim
        self.head_dim = head_dim
        self.is_causal = is_causal
        self.attn_dropout = attn_dropout
        self.q_proj = q_proj
        self.k_proj = k_proj
        self.v_proj = v_proj
        self.output_proj = output_proj
        self.pos_embeddings = pos_embeddings

    def forward(self, x, y=None, *, mask=None, input_pos=None):
        b, s_x, _ = x.shape
        y = x if y is None else y
        s_y = y.shape[1]
        q = self.q_proj(x).view(b, s_x, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(y).view(b, s_y, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(y).view(b, s_y, -1, self.head_dim).transpose(1, 2)

        output = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=self.attn_dropout if self.training else 0.0,
            is_causal=mask is None and self.is_causal,
        )
        output = output.transpose(1, 2).contiguous().view(b, s_x, -1)
        return output


class TransformerSelfAttentionLayer(nn.Module):
    def __init__(self, attn, mlp, sa_norm, mlp_norm):
        super().__init__()
        self.attn = attn
        self.mlp = mlp
        self.sa_norm = sa_norm
        self.mlp_norm = mlp_norm

    def forward(self, x, *, mask=None, input_pos=None):
        h = self.sa_norm(x)
        h = self.attn(h, h, mask=mask, input_pos=input_pos) + x
        return h + self.mlp(self.mlp_norm(h))


def tiny_self_attention_layer():
    embed_dim, num_heads, head_dim = 24, 4, 6
    attn = MultiHeadAttention(
        embed_dim=embed_dim,
        num_heads=num_heads,
        num_kv_heads=num_heads,
        head_dim=head_dim,
        q_proj=nn.Linear(embed_dim, num_heads * head_dim, bias=False),
        k_proj=nn.Linear(embed_dim, num_heads * head_dim, bias=False),
        v_proj=nn.Linear(embed_dim, num_heads * head_dim, bias=False),
        output_proj=nn.Linear(num_heads * head_dim, embed_dim, bias=False),
    )
    mlp = nn.Sequential(
        nn.Linear(embed_dim, 48, bias=False), nn.SiLU(), nn.Linear(48, embed_dim, bias=False)
    )
    return TransformerSelfAttentionLayer(attn, mlp, nn.RMSNorm(embed_dim), nn.RMSNorm(embed_dim))


EXPECT = {
    "target": "tiny_self_attention_layer",
    "kind": "causal-multihead",
    "ok": False,
    "stage": "output",
    "mistake": "missing_out_proj",
    "layer": "attn",
    "style": "torchtune MultiHeadAttention + TransformerSelfAttentionLayer (output_proj never applied)",
}

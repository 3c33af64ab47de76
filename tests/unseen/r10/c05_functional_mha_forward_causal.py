"""A causal self-attention module that calls torch.nn.functional.multi_head_attention_forward
directly (as torchaudio/fairseq-era code does), written from scratch.

Separate q/k/v weights handed over with use_separate_proj_weight=True, one packed in_proj_bias,
sequence-first tensors inside, a float causal mask of -inf above the diagonal, out_proj applied
by the functional call. The target is a pre-norm block taking batch-first input.
"""

import torch
import torch.nn.functional as F
from torch import nn


class FunctionalCausalSelfAttention(nn.Module):
    def __init__(self, embed_dim=48, num_heads=3):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.q_proj_weight = nn.Parameter(torch.empty(embed_dim, embed_dim))
        self.k_proj_weight = nn.Parameter(torch.empty(embed_dim, embed_dim))
        self.v_proj_weight = nn.Parameter(torch.empty(embed_dim, embed_dim))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim))
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        for w in (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight):
            nn.init.xavier_uniform_(w)
        nn.init.uniform_(self.in_proj_bias, -0.1, 0.1)

    def forward(self, x):
        # x: (T, B, C)
        T = x.size(0)
        causal = torch.triu(
            torch.full((T, T), float("-inf"), dtype=x.dtype, device=x.device), diagonal=1
        )
        out, _ = F.multi_head_attention_forward(
            x,
            x,
            x,
            self.embed_dim,
            self.num_heads,
            in_proj_weight=None,
            in_proj_bias=self.in_proj_bias,
            bias_k=None,
            bias_v=None,
            add_zero_attn=False,
            dropout_p=0.0,
            out_proj_weight=self.out_proj.weight,
            out_proj_bias=self.out_proj.bias,
            training=self.training,
            need_weights=False,
            attn_mask=causal,
            use_separate_proj_weight=True,
            q_proj_weight=self.q_proj_weight,
            k_proj_weight=self.k_proj_weight,
            v_proj_weight=self.v_proj_weight,
        )
        return out


class Block(nn.Module):
    def __init__(self, embed_dim=48, num_heads=3):
        super().__init__()
        self.ln = nn.LayerNorm(embed_dim)
        self.attn = FunctionalCausalSelfAttention(embed_dim, num_heads)

    def forward(self, x):
        h = self.ln(x).transpose(0, 1)
        return x + self.attn(h).transpose(0, 1)


def make_functional_block():
    torch.manual_seed(1005)
    block = Block()
    with torch.no_grad():
        block.ln.weight.uniform_(0.5, 1.5)
        block.ln.bias.uniform_(-0.2, 0.2)
    return block.eval()


EXPECT = {
    "target": "make_functional_block",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "attn",
    "structure": {
        "heads": 3,
        "kv_heads": 3,
        "head_dim": 16,
        "causal": True,
        "cross": False,
        "rope": None,
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "F.multi_head_attention_forward called directly (use_separate_proj_weight=True, packed in_proj_bias, "
    "sequence-first, float -inf triu causal mask), inside a batch-first pre-LayerNorm block",
}

"""GPT-SoVITS text-to-semantic (AR) decoder attention, written like its fast-inference T2S blocks:
one fused in_proj (3 x hidden, with bias) chunked into q, k, v, heads split by view/transpose, an
out_proj, post-norm blocks (LayerNorm after each residual, as norm_first=False), and a boolean
attention mask the decoder builds once (True = blocked, torch.nn.MultiheadAttention convention),
inverted for F.scaled_dot_product_attention or used with masked_fill on the eager path.

This file: correct: fused in_proj chunked q/k/v, 4 heads of 16, decoder-built boolean causal mask (True = blocked) inverted for SDPA"""

import math

import torch
import torch.nn.functional as F
from torch import nn


class T2SConfig:
    hidden_dim = 64
    n_head = 4
    ffn_dim = 128
    attn_impl = "sdpa"


class T2SAttention(nn.Module):
    def __init__(self, n_head, hidden_dim, attn_impl):
        super().__init__()
        self.n_head = n_head
        self.hidden_dim = hidden_dim
        self.head_dim = hidden_dim // n_head
        self.attn_impl = attn_impl
        # key, query, value projections for all heads, in one matmul
        self.in_proj = nn.Linear(hidden_dim, hidden_dim * 3, bias=True)
        self.out_proj = nn.Linear(hidden_dim, hidden_dim, bias=True)

    def eager_attention(self, q, k, v, attn_mask):
        scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(attn_mask, float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        return torch.einsum("bhqk,bhkd->bhqd", weights, v)

    def forward(self, x, attn_mask):
        bsz, seq_len, _ = x.shape
        q, k, v = self.in_proj(x).chunk(3, dim=-1)
        q = q.view(bsz, seq_len, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(bsz, seq_len, self.n_head, self.head_dim).transpose(1, 2)
        v = v.view(bsz, seq_len, self.n_head, self.head_dim).transpose(1, 2)
        if self.attn_impl == "sdpa":
            attn = F.scaled_dot_product_attention(q, k, v, ~attn_mask)
        else:
            attn = self.eager_attention(q, k, v, attn_mask)
        attn = attn.transpose(1, 2).reshape(bsz, seq_len, self.hidden_dim)
        return self.out_proj(attn)


class T2SFeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.linear1 = nn.Linear(dim, hidden)
        self.linear2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.linear2(F.relu(self.linear1(x)))


class T2SBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attn = T2SAttention(config.n_head, config.hidden_dim, config.attn_impl)
        self.norm1 = nn.LayerNorm(config.hidden_dim)
        self.mlp = T2SFeedForward(config.hidden_dim, config.ffn_dim)
        self.norm2 = nn.LayerNorm(config.hidden_dim)

    def forward(self, x, attn_mask):
        x = self.norm1(x + self.attn(x, attn_mask))
        x = self.norm2(x + self.mlp(x))
        return x


class T2STransformer(nn.Module):
    def __init__(self, config, num_blocks=1):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList([T2SBlock(config) for _ in range(num_blocks)])

    def forward(self, xy_pos):
        bsz, seq_len, _ = xy_pos.shape
        device = xy_pos.device
        # semantic tokens are generated left to right: block every key after the query
        xy_attn_mask = torch.triu(
            torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1
        )[None, None]
        # key padding (all frames valid here), kept for the batched-inference path
        padding_mask = torch.zeros(bsz, 1, 1, seq_len, dtype=torch.bool, device=device)
        attn_mask = xy_attn_mask | padding_mask
        x = xy_pos
        for layer in self.layers:
            x = layer(x, attn_mask)
        return x


def make_gptsovits_t2s():
    torch.manual_seed(4108)
    model = T2STransformer(T2SConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
            elif isinstance(mod, nn.Linear):
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {
    "target": "make_gptsovits_t2s",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "layers.0.attn",
    "structure": {
        "heads": 4,
        "kv_heads": 4,
        "head_dim": 16,
        "causal": True,
        "cross": False,
        "rope": None,
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "GPT-SoVITS T2S AR attention (c08_gptsovits_t2s_causal_sdpa): correct: fused in_proj "
    "chunked q/k/v, 4 heads of 16, decoder-built boolean causal mask (True = blocked) "
    "inverted for SDPA",
}

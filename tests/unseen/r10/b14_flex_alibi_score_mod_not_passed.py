"""FlexAttention-style ALiBi: the alibi score_mod is defined but not passed to flex_attention, only the causal mask_mod."""

import torch
from torch import nn


def generate_alibi_bias(num_heads):
    h = torch.arange(num_heads, dtype=torch.float64)
    return torch.exp2(-((h + 1) * 8.0 / num_heads))


def causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def flex_attention_fallback(query, key, value, score_mod=None, mask_mod=None, scale=None):
    B, H, L, E = query.shape
    S = key.shape[-2]
    scale = E**-0.5 if scale is None else scale
    scores = (query @ key.transpose(-2, -1)) * scale
    b = torch.arange(B).view(B, 1, 1, 1)
    h = torch.arange(H).view(1, H, 1, 1)
    q_idx = torch.arange(L).view(1, 1, L, 1)
    kv_idx = torch.arange(S).view(1, 1, 1, S)
    if score_mod is not None:
        scores = score_mod(scores, b, h, q_idx, kv_idx)
    if mask_mod is not None:
        keep = mask_mod(b, h, q_idx, kv_idx)
        scores = scores.masked_fill(~keep, float("-inf"))
    return torch.softmax(scores, dim=-1) @ value


class FlexAlibiAttention(nn.Module):
    def __init__(self, dim=64, n_heads=4):
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.register_buffer("alibi_bias", generate_alibi_bias(n_heads), persistent=False)

    def forward(self, x):
        bsz, seqlen, _ = x.shape
        q = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(bsz, seqlen, self.n_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(bsz, seqlen, self.n_heads, self.head_dim).transpose(1, 2)
        alibi_bias = self.alibi_bias.to(q.dtype)

        def alibi(score, b, h, q_idx, kv_idx):
            bias = alibi_bias[h] * (kv_idx - q_idx)
            return score + bias

        out = flex_attention_fallback(q, k, v, mask_mod=causal_mask)
        out = out.transpose(1, 2).reshape(bsz, seqlen, -1)
        return self.wo(out)


class AlibiBlock(nn.Module):
    def __init__(self, dim=64, n_heads=4):
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim, eps=1e-6)
        self.attention = FlexAlibiAttention(dim, n_heads)

    def forward(self, x):
        return x + self.attention(self.attention_norm(x))


def make_flex_alibi_block():
    torch.manual_seed(1006)
    block = AlibiBlock()
    with torch.no_grad():
        block.attention_norm.weight.uniform_(0.5, 1.5)
    return block.eval()


EXPECT = {
    "target": "make_flex_alibi_block",
    "kind": "causal-multihead",
    "ok": False,
    "layer": "attention",
    "stage": "biased_scores",
    "mistake": "bias_missing",
    "style": "FlexAttention-style ALiBi: the alibi score_mod is defined but not passed to flex_attention, "
    "only the causal mask_mod",
}

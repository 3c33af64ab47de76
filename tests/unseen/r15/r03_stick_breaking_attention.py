"""IBM stick-breaking attention (Tan et al., 2024, "Scaling Stick-Breaking Attention"), written in
log space as in the reference PyTorch implementation: beta_ij = sigmoid(q_i . k_j / sqrt(d)), and
query i gives key j the weight beta_ij * prod_{j < k <= i} (1 - beta_ik), breaking the stick from
the nearest key backwards. No softmax and no position embedding. Pre-norm decoder block.

This file: refused (stick-breaking weights instead of a softmax)."""

import torch
import torch.nn.functional as F
from torch import nn


class StickBreakingAttention(nn.Module):
    def __init__(self, d_model=64, n_heads=4):
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        logits = (q @ k.transpose(-1, -2)) * self.head_dim**-0.5
        log_beta = F.logsigmoid(logits)
        log_one_minus = F.logsigmoid(-logits)
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        log_one_minus = log_one_minus.masked_fill(~causal, 0.0)
        # sum_{j < k <= i} log(1 - beta_ik): reverse cumulative sum along keys, excluding j itself
        rev = torch.flip(torch.cumsum(torch.flip(log_one_minus, [-1]), -1), [-1])
        log_att = log_beta + rev - log_one_minus
        att = torch.exp(log_att).masked_fill(~causal, 0.0)
        ctx = (att @ v).transpose(1, 2).reshape(b, n, -1)
        return self.out(ctx)


class Block(nn.Module):
    def __init__(self, d_model=64):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = StickBreakingAttention(d_model)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 128), nn.GELU(), nn.Linear(128, d_model))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class StickBreakingLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block()])
        self.ln_f = nn.LayerNorm(64)

    def forward(self, x):
        for blk in self.blocks:
            x = blk(x)
        return self.ln_f(x)


def make_stickbreaking():
    torch.manual_seed(1553)
    model = StickBreakingLM()
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {
    "target": "make_stickbreaking",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "blocks.0.attn",
    "unsupported": "stick_breaking",
    "style": "stick-breaking attention (Tan et al. 2024) in log space: logsigmoid logits, reverse cumsum of "
    "log(1 - beta) over nearer keys, exp, no softmax; fused qkv, pre-norm block",
}

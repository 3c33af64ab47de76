"""min-decision-transformer (nikhilbarhate99) MaskedCausalAttention in its post-LN Block
(Attention -> LayerNorm -> MLP -> LayerNorm) inside a DecisionTransformer trunk that adds the timestep
embedding of each (return, state, action) triple: q_net/k_net/v_net/proj_net with bias,
view(B, T, N, D).transpose(1, 2), q @ k^T / sqrt(D), masked_fill with a registered tril(ones) buffer
(== 0 -> -inf), softmax, @ v, transpose/view back, proj_net.

This file: bug. Scores divided by sqrt(C) = sqrt(h_dim) = 8 instead of sqrt(D) = 4."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class MaskedCausalAttention(nn.Module):
    def __init__(self, h_dim, max_T, n_heads, drop_p):
        super().__init__()
        self.n_heads = n_heads
        self.max_T = max_T
        self.q_net = nn.Linear(h_dim, h_dim)
        self.k_net = nn.Linear(h_dim, h_dim)
        self.v_net = nn.Linear(h_dim, h_dim)
        self.proj_net = nn.Linear(h_dim, h_dim)
        self.att_drop = nn.Dropout(drop_p)
        self.proj_drop = nn.Dropout(drop_p)
        ones = torch.ones((max_T, max_T))
        mask = torch.tril(ones).view(1, 1, max_T, max_T)
        # register buffer makes sure mask does not get updated during backpropagation
        self.register_buffer("mask", mask)

    def forward(self, x):
        B, T, C = x.shape  # batch size, seq length, h_dim * n_heads
        N, D = self.n_heads, C // self.n_heads  # N = num heads, D = attention dim
        # rearrange q, k, v as (B, N, T, D)
        q = self.q_net(x).view(B, T, N, D).transpose(1, 2)
        k = self.k_net(x).view(B, T, N, D).transpose(1, 2)
        v = self.v_net(x).view(B, T, N, D).transpose(1, 2)
        # weights (B, N, T, T)
        weights = q @ k.transpose(2, 3) / math.sqrt(C)
        # causal mask applied to weights
        weights = weights.masked_fill(self.mask[..., :T, :T] == 0, float("-inf"))
        # normalize weights, all -inf -> 0 after softmax
        normalized_weights = F.softmax(weights, dim=-1)
        # attention (B, N, T, D)
        attention = self.att_drop(normalized_weights @ v)
        # gather heads and project (B, N, T, D) -> (B, T, N*D)
        attention = attention.transpose(1, 2).contiguous().view(B, T, N * D)
        out = self.proj_drop(self.proj_net(attention))
        return out


class Block(nn.Module):
    def __init__(self, h_dim, max_T, n_heads, drop_p):
        super().__init__()
        self.attention = MaskedCausalAttention(h_dim, max_T, n_heads, drop_p)
        self.mlp = nn.Sequential(
            nn.Linear(h_dim, 4 * h_dim),
            nn.GELU(),
            nn.Linear(4 * h_dim, h_dim),
            nn.Dropout(drop_p),
        )
        self.ln1 = nn.LayerNorm(h_dim)
        self.ln2 = nn.LayerNorm(h_dim)

    def forward(self, x):
        # Attention -> LayerNorm -> MLP -> LayerNorm
        x = x + self.attention(x)  # residual
        x = self.ln1(x)
        x = x + self.mlp(x)  # residual
        x = self.ln2(x)
        return x


class DecisionTransformer(nn.Module):
    """min-decision-transformer trunk on already-embedded (return, state, action) tokens,
    stacked as r_0, s_0, a_0, r_1, ...: adds the timestep embedding of each triple."""

    def __init__(
        self, n_blocks=1, h_dim=64, context_len=64, n_heads=4, drop_p=0.1, max_timestep=64
    ):
        super().__init__()
        self.h_dim = h_dim
        input_seq_len = 3 * context_len
        blocks = [Block(h_dim, input_seq_len, n_heads, drop_p) for _ in range(n_blocks)]
        self.transformer = nn.Sequential(*blocks)
        self.embed_ln = nn.LayerNorm(h_dim)
        self.embed_timestep = nn.Embedding(max_timestep, h_dim)

    def forward(self, h):
        B, T, _ = h.shape
        timesteps = torch.arange(T, device=h.device) // 3
        h = h + self.embed_timestep(timesteps).to(h.dtype).unsqueeze(0)
        h = self.embed_ln(h)
        return self.transformer(h)


def make_decision_transformer():
    torch.manual_seed(1313)
    model = DecisionTransformer()
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {
    "target": "make_decision_transformer",
    "kind": "causal-multihead",
    "ok": False,
    "layer": "transformer.0.attention",
    "stage": "scaled_scores",
    "mistake": "wrong_scale",
    "style": "min-decision-transformer: weights / math.sqrt(C) (h_dim 64) instead of sqrt(D) (16)",
}

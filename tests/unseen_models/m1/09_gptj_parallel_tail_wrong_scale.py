"""A small GPT whose last block(s) use a GPT-J-style parallel residual (attention and MLP read
the same LayerNorm output and are summed), chosen per layer by config.parallel_from.  Learned
absolute positions, separate q/k/v/out projections with bias, explicit attention math.

Slip: the parallel block's attention (ParallelAttention, a subclass written for the GPT-J
port) sets its scale from the model width, (n_embd) ** -0.5, instead of the head size.  Only
blocks.2.attn uses it; blocks 0 and 1 are right.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["blocks.0.attn", "blocks.1.attn", "blocks.2.attn"],
    "kind": "causal-multihead",
    "layer": "blocks.2.attn",
    "stage": "scaled_scores",
    "mistake": "wrong_scale",
    "cache": None,
    "style": "GPT-2/GPT-J hybrid with a per-layer parallel block; slip: the parallel block's attention "
    "scales by 1/sqrt(n_embd)=1/sqrt(80) instead of 1/sqrt(head_dim)=1/4",
}


class Config:
    vocab_size = 140
    block_size = 64
    n_layer = 3
    n_head = 5
    n_embd = 80
    parallel_from = 2  # blocks with index >= parallel_from use the parallel residual


class SelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_head = config.n_head
        self.head_dim = config.n_embd // config.n_head
        self.q_proj = nn.Linear(config.n_embd, config.n_embd)
        self.k_proj = nn.Linear(config.n_embd, config.n_embd)
        self.v_proj = nn.Linear(config.n_embd, config.n_embd)
        self.out_proj = nn.Linear(config.n_embd, config.n_embd)
        self.scale = self.head_dim**-0.5
        self.register_buffer(
            "causal",
            torch.tril(torch.ones(config.block_size, config.block_size, dtype=torch.bool)),
            persistent=False,
        )

    def _split(self, t):
        B, T, _ = t.shape
        return t.view(B, T, self.n_head, self.head_dim).transpose(1, 2)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (
            self._split(self.q_proj(x)),
            self._split(self.k_proj(x)),
            self._split(self.v_proj(x)),
        )
        att = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        att = att.masked_fill(~self.causal[:T, :T], torch.finfo(att.dtype).min)
        att = F.softmax(att, dim=-1)
        y = torch.matmul(att, v).transpose(1, 2).reshape(B, T, C)
        return self.out_proj(y)


class ParallelAttention(SelfAttention):
    def __init__(self, config):
        super().__init__(config)
        self.scale = config.n_embd**-0.5


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.fc_in = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.fc_out = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x):
        return self.fc_out(F.gelu(self.fc_in(x), approximate="tanh"))


class SequentialBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = SelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class ParallelBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = ParallelAttention(config)
        self.mlp = MLP(config)

    def forward(self, x):
        h = self.ln_1(x)
        return x + self.attn(h) + self.mlp(h)


class HybridGPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(
            [
                ParallelBlock(config) if i >= config.parallel_from else SequentialBlock(config)
                for i in range(config.n_layer)
            ]
        )
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, input_ids):
        T = input_ids.shape[1]
        pos = torch.arange(T, device=input_ids.device)
        x = self.wte(input_ids) + self.wpe(pos)[None]
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def make_model():
    torch.manual_seed(6)
    model = HybridGPT(Config())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn_like(m.weight))
                m.bias.copy_(0.1 * torch.randn_like(m.bias))
    return model.eval()

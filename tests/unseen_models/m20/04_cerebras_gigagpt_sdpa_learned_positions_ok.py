"""Cerebras gigaGPT (model.py, the ~500-line GPT-2 for Cerebras wafers) in plain torch.

GPTModel: `wte`, `wpe` (learned positions), `decoder` = nn.ModuleList of `Block`s (`ln_1`, `attn`,
`ln_2`, `mlp`), `ln_f`, `lm_head` tied to `wte`.  Attention: separate `proj_q`, `proj_k`, `proj_v`
Linears with bias and `proj_output`, heads split with view + transpose, then
F.scaled_dot_product_attention(is_causal=True).  Pre-LayerNorm GPT-2 with GELU MLP (`fc_1`, `fc_2`).
No cache: `model(ids)` returns the logits tensor.
"""

from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": ["decoder.0.attn", "decoder.1.attn", "decoder.2.attn"],
    "kind": "causal-multihead",
    "cache": None,
    "style": "Cerebras gigaGPT model.py: wte/wpe, decoder ModuleList of pre-LN blocks, proj_q/proj_k/proj_v/"
    "proj_output with bias, SDPA is_causal, tied lm_head",
}


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_head = cfg.n_head
        self.proj_q = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.proj_k = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.proj_v = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.proj_output = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x):
        B, T, C = x.shape
        q = self.proj_q(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = self.proj_k(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = self.proj_v(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj_output(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.fc_1 = nn.Linear(cfg.hidden_size, 4 * cfg.hidden_size)
        self.fc_2 = nn.Linear(4 * cfg.hidden_size, cfg.hidden_size)

    def forward(self, x):
        return self.fc_2(F.gelu(self.fc_1(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden_size)
        self.attn = Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.hidden_size)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPTModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.wpe = nn.Embedding(cfg.block_size, cfg.hidden_size)
        self.decoder = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for block in self.decoder:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def make_model():
    torch.manual_seed(2004)
    cfg = SimpleNamespace(vocab_size=96, hidden_size=64, n_head=4, n_layer=3, block_size=64)
    model = GPTModel(cfg)
    g = torch.Generator().manual_seed(20041)
    with torch.no_grad():
        model.wpe.weight.normal_(0.0, 0.5, generator=g)
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model.eval()

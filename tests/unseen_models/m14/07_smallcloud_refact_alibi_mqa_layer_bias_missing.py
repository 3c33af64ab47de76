"""smallcloudai Refact-1.6B remote code (modeling_gpt_refact.py), reduced.

GPTRefactForCausalLM: transformer (GPTRefactModel: wte, h.N, ln_f) and lm_head.  GPTRefactBlock is
pre-norm with RMSNorm (ln_1 -> attn -> + residual -> ln_2 -> mlp -> + residual); the MLP is LLaMA-style
(gate_up_proj fused then chunked, SiLU, c_proj).  Attention: multi-query (separate `q` Linear for all
heads, `k` and `v` Linear of one head_dim each, no bias), no position embedding at all: ALiBi with
the standard slopes for 4 heads (2^-2, 2^-4, 2^-6, 2^-8), bias slope * (j - i) added after the
1/sqrt(head_dim) scale, then the causal mask, softmax, c_proj.
Slip: the ALiBi tensor is built once by the model (`get_alibi_biases`) and passed to every block,
but layer 1 was constructed with `alibi_in_kernel=True` (a leftover of the Triton kernel path that
adds the bias itself), so its eager attention never adds it.  No cache.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": [
        "transformer.h.0.attn",
        "transformer.h.1.attn",
        "transformer.h.2.attn",
    ],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "transformer.h.1.attn",
    "stage": "biased_scores",
    "mistake": "bias_missing",
    "style": "Refact-1.6B modeling_gpt_refact.py: GPT-2 tree with RMSNorm ln_1/ln_2, MQA q/k/v Linears, ALiBi "
    "from get_alibi_biases (4 heads) and no positions, gate_up_proj MLP; layer 1 skips the ALiBi add",
}


def get_alibi_biases(n_heads, seq_len, dtype):
    m0 = 2.0 ** (-8.0 / n_heads)
    slopes = torch.pow(m0, torch.arange(1, n_heads + 1, dtype=torch.float64))
    pos = torch.arange(seq_len, dtype=torch.float64)
    distance = pos[None, :] - pos[:, None]  # j - i (<= 0 for the past)
    return (slopes[:, None, None] * distance[None]).to(dtype)[None]  # (1, h, q, k)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.embed_dim = config.n_embd
        self.num_heads = config.n_head
        self.head_dim = self.embed_dim // self.num_heads
        self.scale_factor = self.head_dim ** -0.5
        self.q = nn.Linear(self.embed_dim, self.embed_dim, bias=False)
        self.k = nn.Linear(self.embed_dim, self.head_dim, bias=False)
        self.v = nn.Linear(self.embed_dim, self.head_dim, bias=False)
        self.c_proj = nn.Linear(self.embed_dim, self.embed_dim, bias=False)
        self.alibi_in_kernel = layer_idx in config.kernel_alibi_layers

    def forward(self, x, alibi):
        b, t, _ = x.shape
        query = self.q(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        key = self.k(x).view(b, t, 1, self.head_dim).transpose(1, 2)
        value = self.v(x).view(b, t, 1, self.head_dim).transpose(1, 2)
        attn_weights = torch.matmul(query * self.scale_factor, key.transpose(-1, -2))
        if not self.alibi_in_kernel:
            attn_weights = attn_weights + alibi
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        attn_weights = attn_weights.masked_fill(~causal, torch.finfo(attn_weights.dtype).min)
        attn_weights = torch.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, value)
        attn_output = attn_output.transpose(1, 2).reshape(b, t, self.embed_dim)
        return self.c_proj(attn_output)


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.hidden = config.n_inner
        self.gate_up_proj = nn.Linear(config.n_embd, 2 * self.hidden, bias=False)
        self.c_proj = nn.Linear(self.hidden, config.n_embd, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.c_proj(F.silu(gate) * up)


class GPTRefactBlock(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.ln_1 = RMSNorm(config.n_embd)
        self.attn = Attention(config, layer_idx)
        self.ln_2 = RMSNorm(config.n_embd)
        self.mlp = LlamaMLP(config)

    def forward(self, x, alibi):
        x = x + self.attn(self.ln_1(x), alibi)
        return x + self.mlp(self.ln_2(x))


class GPTRefactModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.h = nn.ModuleList(GPTRefactBlock(config, i) for i in range(config.n_layer))
        self.ln_f = RMSNorm(config.n_embd)

    def forward(self, input_ids):
        x = self.wte(input_ids)
        alibi = get_alibi_biases(self.config.n_head, input_ids.shape[1], x.dtype)
        for block in self.h:
            x = block(x, alibi)
        return self.ln_f(x)


class GPTRefactForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.transformer = GPTRefactModel(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, input_ids):
        return self.lm_head(self.transformer(input_ids))


class GPTRefactConfig:
    vocab_size = 96
    n_embd = 64
    n_head = 4
    n_layer = 3
    n_inner = 128
    kernel_alibi_layers = (1,)


def make_model():
    torch.manual_seed(1407)
    model = GPTRefactForCausalLM(GPTRefactConfig())
    g = torch.Generator().manual_seed(14071)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

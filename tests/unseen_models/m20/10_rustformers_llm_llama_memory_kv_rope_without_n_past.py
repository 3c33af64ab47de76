"""rustformers/llm LLaMA (crates/models/llama, a GGML graph builder in Rust) ported to PyTorch.

Llama: `wte`, `layers.N` (Layer: `attention_norm`, `attention` holding `wq`/`wk`/`wv`/`wo`, `ffn_norm`,
`w1`/`w2`/`w3`), `norm`, `output`.  The inference session owns `memory_k`/`memory_v`: flat buffers of
n_layer * n_ctx * n_embd (here per layer (batch, n_ctx 64, n_embd), batch <= 4) written at `n_past`
and read back as [0, n_past + N).  GGML's rope in normal mode rotates adjacent pairs (x[2i], x[2i+1]),
base 1e4; MHA 4x16; KQ scaled by 1/sqrt(head_dim), `diag_mask_inf(n_past)`, softmax, KQV, `wo`.
Cache: book-buffers: `model.reset_kv_cache()`, `model(prompt, use_cache=True)`,
`model(tok, use_cache=True)`; `model(ids)` alone touches no memory.  Returns the logits tensor.
Slip: the rope call is given `0` where the Rust passes `session_len` (n_past), a leftover of the
prompt-only evaluation path: each decoded token's query and key are rotated as if at position 0.  The
memory, the mask and n_past itself are right.
"""

from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["layers.0.attention", "layers.1.attention", "layers.2.attention"],
    "kind": "causal-multihead",
    "cache": "book-buffers",
    "decode": {
        "mistake": "cache_positions",
        "step": 0,
        "layer": "layers.0.attention",
    },
    "style": "rustformers/llm llama ported: memory_k/memory_v session buffers written at n_past, GGML normal-mode "
    "(adjacent pair) rope base 1e4, diag_mask_inf(n_past); slip: rope offset 0 instead of n_past",
}

N_CTX = 64
MAX_BATCH = 4


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def ggml_rope(x, n_past, base):
    # x (b, N, h, d): adjacent pairs, positions n_past .. n_past + N - 1
    N, d = x.shape[1], x.shape[-1]
    theta = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = (n_past + torch.arange(N, dtype=torch.float64))[:, None] * theta[None]
    c, s = ang.cos().to(x.dtype)[None, :, None], ang.sin().to(x.dtype)[None, :, None]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, n_embd, n_head, base):
        super().__init__()
        self.n_head, self.head_dim, self.base = n_head, n_embd // n_head, base
        self.wq = nn.Linear(n_embd, n_embd, bias=False)
        self.wk = nn.Linear(n_embd, n_embd, bias=False)
        self.wv = nn.Linear(n_embd, n_embd, bias=False)
        self.wo = nn.Linear(n_embd, n_embd, bias=False)

    def forward(self, x, n_past, memory, rope_offset):
        b, N, C = x.shape
        q = ggml_rope(self.wq(x).view(b, N, self.n_head, self.head_dim), rope_offset, self.base)
        k = ggml_rope(self.wk(x).view(b, N, self.n_head, self.head_dim), rope_offset, self.base)
        v = self.wv(x)
        if memory is not None:
            mk, mv = memory
            mk[:b, n_past:n_past + N] = k.reshape(b, N, C).to(mk.dtype)
            mv[:b, n_past:n_past + N] = v.to(mv.dtype)
            k = mk[:b, : n_past + N].to(x.dtype).view(b, n_past + N, self.n_head, self.head_dim)
            v = mv[:b, : n_past + N].to(x.dtype)
        L = k.shape[1]
        v = v.view(b, L, self.n_head, self.head_dim)
        kq = torch.einsum("bnhd,blhd->bhnl", q, k) / (self.head_dim**0.5)
        past = L - N
        masked = torch.arange(L)[None, :] > (past + torch.arange(N))[:, None]
        kq = kq.masked_fill(masked.to(x.device), float("-inf"))
        kq = F.softmax(kq, dim=-1)
        kqv = torch.einsum("bhnl,blhd->bnhd", kq, v).reshape(b, N, C)
        return self.wo(kqv)


class Layer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.n_embd)
        self.attention = Attention(cfg.n_embd, cfg.n_head, cfg.rope_base)
        self.ffn_norm = RMSNorm(cfg.n_embd)
        self.w1 = nn.Linear(cfg.n_embd, cfg.n_ff, bias=False)
        self.w2 = nn.Linear(cfg.n_ff, cfg.n_embd, bias=False)
        self.w3 = nn.Linear(cfg.n_embd, cfg.n_ff, bias=False)

    def forward(self, x, n_past, memory, rope_offset):
        x = x + self.attention(self.attention_norm(x), n_past, memory, rope_offset)
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.n_vocab, cfg.n_embd)
        self.layers = nn.ModuleList([Layer(cfg) for _ in range(cfg.n_layer)])
        self.norm = RMSNorm(cfg.n_embd)
        self.output = nn.Linear(cfg.n_embd, cfg.n_vocab, bias=False)
        self.register_buffer("memory_k", torch.zeros(cfg.n_layer, MAX_BATCH, N_CTX, cfg.n_embd), persistent=False)
        self.register_buffer("memory_v", torch.zeros(cfg.n_layer, MAX_BATCH, N_CTX, cfg.n_embd), persistent=False)
        self.n_past = 0

    def reset_kv_cache(self):
        self.n_past = 0
        self.memory_k.zero_()
        self.memory_v.zero_()

    def forward(self, input_tokens, use_cache=False):
        N = input_tokens.shape[1]
        n_past = self.n_past if use_cache else 0
        rope_offset = n_past if N > 1 else 0
        x = self.wte(input_tokens)
        for il, layer in enumerate(self.layers):
            memory = (self.memory_k[il], self.memory_v[il]) if use_cache else None
            x = layer(x, n_past, memory, rope_offset)
        if use_cache:
            self.n_past += N
        return self.output(self.norm(x))


def make_model():
    torch.manual_seed(2010)
    cfg = SimpleNamespace(n_vocab=96, n_embd=64, n_ff=128, n_head=4, n_layer=3, rope_base=10000.0)
    model = Llama(cfg)
    g = torch.Generator().manual_seed(20101)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

"""OpenAI's original GPT-2 code (openai/gpt-2 `src/model.py`, TensorFlow) ported to torch the way a
line-by-line port looks (written from memory, in my own words): the TF variable scopes become a
`ModuleDict` named `model` holding `wte`, `wpe`, `h0`, `h1`, `h2`, `ln_f`; `norm()` keeps TF's `g`/`b`
names; `Conv1d` holds `w` (1, nx, nf) and `b` like the TF variables and is applied as a matmul;
`attn` = c_attn → `split_states`/`split_heads` → `multihead_attn` (w = q·kᵀ, w × rsqrt(head_dim),
`mask_attn_weights` with `attention_mask(nd, ns)` and w·b − 1e10·(1 − b), softmax, w·v) →
`merge_heads` → c_proj; `mlp` (c_fc, TF's tanh gelu, c_proj); learned positions from
`positions_for(tokens, past_length)`; logits against `wte`.  3 blocks, n_embd 64, 4 heads, vocab
110, n_ctx 64.  No cache (the TF `past` tensor is not exposed).  Returns logits as a tensor.

Slip: block h2 is built with `hparams.mask_late = [False, False, True]`: its attention applies
`mask_attn_weights` *after* the softmax (the masked weights are zeroed, the rest not renormalised).
`model.h2.attn`, stage `weights`, `mask_after_softmax`.
"""

import math

import torch
import torch.nn as nn

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["model.h0.attn", "model.h1.attn", "model.h2.attn"],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "model.h2.attn",
    "stage": "weights",
    "mistake": "mask_after_softmax",
    "style": "openai/gpt-2 src/model.py ported: ModuleDict `model` with h0/h1/h2 scopes, TF-named Conv1d w (1, nx, nf), "
    "norm g/b, attention_mask(nd, ns) with w*b - 1e10*(1-b); slip: h2 masks after the softmax",
}


class HParams:
    n_vocab = 110
    n_ctx = 64
    n_embd = 64
    n_head = 4
    n_layer = 3
    mask_late = [False, False, True]


def gelu(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * torch.pow(x, 3))))


def softmax(x, axis=-1):
    x = x - torch.max(x, dim=axis, keepdim=True).values
    ex = torch.exp(x)
    return ex / torch.sum(ex, dim=axis, keepdim=True)


class Norm(nn.Module):
    def __init__(self, n_state, epsilon=1e-5):
        super().__init__()
        self.g = nn.Parameter(torch.ones(n_state))
        self.b = nn.Parameter(torch.zeros(n_state))
        self.epsilon = epsilon

    def forward(self, x):
        u = torch.mean(x, dim=-1, keepdim=True)
        s = torch.mean(torch.square(x - u), dim=-1, keepdim=True)
        x = (x - u) * torch.rsqrt(s + self.epsilon)
        return x * self.g + self.b


class Conv1d(nn.Module):
    def __init__(self, nx, nf, w_init_stdev=0.02):
        super().__init__()
        self.w = nn.Parameter(torch.randn(1, nx, nf) * w_init_stdev)
        self.b = nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        *start, nx = x.shape
        return (x.reshape(-1, nx) @ self.w[0] + self.b).reshape(*start, -1)


def attention_mask(nd, ns, dtype):
    i = torch.arange(nd)[:, None]
    j = torch.arange(ns)
    m = i >= j - ns + nd
    return m.to(dtype)


class Attn(nn.Module):
    def __init__(self, n_state, hparams, mask_late=False):
        super().__init__()
        assert n_state % hparams.n_head == 0
        self.n_head = hparams.n_head
        self.c_attn = Conv1d(n_state, n_state * 3)
        self.c_proj = Conv1d(n_state, n_state)
        self.mask_late = mask_late

    def split_states(self, x, n):
        *start, m = x.shape
        return x.reshape(*start, n, m // n)

    def split_heads(self, x):
        return self.split_states(x, self.n_head).permute(0, 2, 1, 3)

    def merge_heads(self, x):
        x = x.permute(0, 2, 1, 3)
        *start, a, b = x.shape
        return x.reshape(*start, a * b)

    def mask_attn_weights(self, w):
        _, _, nd, ns = w.shape
        b = attention_mask(nd, ns, dtype=w.dtype).reshape(1, 1, nd, ns)
        return w * b - 1e10 * (1 - b) if not self.mask_late else w * b

    def multihead_attn(self, q, k, v):
        w = torch.matmul(q, k.transpose(-1, -2))
        w = w * torch.rsqrt(torch.tensor(float(v.shape[-1]), dtype=w.dtype))
        if not self.mask_late:
            w = self.mask_attn_weights(w)
            w = softmax(w)
        else:
            w = softmax(w)
            w = self.mask_attn_weights(w)
        return torch.matmul(w, v)

    def forward(self, x):
        c = self.c_attn(x)
        q, k, v = map(self.split_heads, torch.split(c, c.shape[-1] // 3, dim=2))
        a = self.multihead_attn(q, k, v)
        return self.c_proj(self.merge_heads(a))


class Mlp(nn.Module):
    def __init__(self, n_state, nx):
        super().__init__()
        self.c_fc = Conv1d(nx, n_state)
        self.c_proj = Conv1d(n_state, nx)

    def forward(self, x):
        return self.c_proj(gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, hparams, mask_late):
        super().__init__()
        nx = hparams.n_embd
        self.ln_1 = Norm(nx)
        self.attn = Attn(nx, hparams, mask_late=mask_late)
        self.ln_2 = Norm(nx)
        self.mlp = Mlp(nx * 4, nx)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Embedding(nn.Module):
    def __init__(self, n, d, stddev):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n, d) * stddev)


def positions_for(tokens, past_length):
    batch_size, nsteps = tokens.shape
    return (past_length + torch.arange(nsteps))[None].expand(batch_size, nsteps)


class GPT2(nn.Module):
    def __init__(self, hparams):
        super().__init__()
        self.hparams = hparams
        scopes = {
            "wpe": Embedding(hparams.n_ctx, hparams.n_embd, 0.01),
            "wte": Embedding(hparams.n_vocab, hparams.n_embd, 0.02),
        }
        for layer in range(hparams.n_layer):
            scopes["h%d" % layer] = Block(hparams, hparams.mask_late[layer])
        scopes["ln_f"] = Norm(hparams.n_embd)
        self.model = nn.ModuleDict(scopes)

    def forward(self, X):
        m = self.model
        h = m["wte"].weight[X] + m["wpe"].weight[positions_for(X, 0)]
        for layer in range(self.hparams.n_layer):
            h = m["h%d" % layer](h)
        h = m["ln_f"](h)
        return h @ m["wte"].weight.T


def make_model():
    torch.manual_seed(6111)
    model = GPT2(HParams())
    with torch.no_grad():
        model.model["wte"].weight.normal_(0.0, 0.5)
        model.model["wpe"].weight.normal_(0.0, 0.2)
        for p in model.parameters():
            if p.dim() == 3:
                p.normal_(0.0, 0.15)
        for mod in model.modules():
            if isinstance(mod, Norm):
                mod.g.copy_(1.0 + 0.3 * torch.randn_like(mod.g))
                mod.b.copy_(0.1 * torch.randn_like(mod.b))
            if isinstance(mod, Conv1d):
                mod.b.copy_(0.05 * torch.randn_like(mod.b))
    return model.eval()

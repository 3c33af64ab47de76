"""picoGPT ("GPT in 60 lines of NumPy") ported to torch, with a past/present cache.

Parameters keep the GPT-2 checkpoint names (wte, wpe, blocks.N.attn.c_attn.w/.b, ln_1.g/.b ...) and
every op is a free function over raw tensors as in gpt2.py: linear is x @ w + b, the causal mask is
(1 - tri) * -1e10 added to the scores, heads are a Python list from torch.split over the feature
axis, each head attended separately and the list concatenated.  The cache keeps keys and values
unsplit, (batch, tokens, n_embd), per block (hf: model(ids, use_cache=True) then
model(tok, past_key_values=out.past_key_values, use_cache=True)).
"""

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn as nn

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": ["blocks.0.attn", "blocks.1.attn", "blocks.2.attn"],
    "kind": "causal-multihead",
    "cache": "hf",
    "structure": {
        "heads": 4,
        "kv_heads": 4,
        "head_dim": 20,
        "causal": True,
        "cross": False,
        "rope": None,
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "picoGPT gpt2.py port: raw-parameter modules (w (in,out), b; g, b), free functions gelu/softmax/layer_norm/"
    "linear/attention, -1e10 additive mask, heads as a list from split over features, unsplit (b, s, d) past tuples",
}

HPARAMS = {"n_vocab": 110, "n_ctx": 64, "n_embd": 80, "n_head": 4, "n_layer": 3}


def gelu(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def softmax(x):
    exp_x = torch.exp(x - torch.amax(x, dim=-1, keepdim=True))
    return exp_x / torch.sum(exp_x, dim=-1, keepdim=True)


def layer_norm(x, g, b, eps: float = 1e-5):
    mean = torch.mean(x, dim=-1, keepdim=True)
    variance = torch.var(x, dim=-1, keepdim=True, unbiased=False)
    x = (x - mean) / torch.sqrt(variance + eps)
    return g * x + b


def linear(x, w, b):
    return x @ w + b


def attention(q, k, v, mask):
    return softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + mask) @ v


class Dense(nn.Module):
    def __init__(self, n_in, n_out):
        super().__init__()
        self.w = nn.Parameter(torch.randn(n_in, n_out) * 0.08)
        self.b = nn.Parameter(torch.randn(n_out) * 0.02)

    def forward(self, x):
        return linear(x, self.w, self.b)


class Norm(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.g = nn.Parameter(torch.ones(n))
        self.b = nn.Parameter(torch.zeros(n))

    def forward(self, x):
        return layer_norm(x, self.g, self.b)


class MHA(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.c_attn = Dense(n_embd, 3 * n_embd)
        self.c_proj = Dense(n_embd, n_embd)

    def forward(self, x, past=None):
        x = self.c_attn(x)
        q, k, v = torch.split(x, x.shape[-1] // 3, dim=-1)
        if past is not None:
            k = torch.cat([past[0], k], dim=1)
            v = torch.cat([past[1], v], dim=1)
        present = (k, v)
        n_q, n_k = q.shape[1], k.shape[1]
        qkv_heads = [torch.split(t, t.shape[-1] // self.n_head, dim=-1) for t in (q, k, v)]
        tri = torch.tril(torch.ones(n_q, n_k, dtype=x.dtype, device=x.device), diagonal=n_k - n_q)
        causal_mask = (1 - tri) * -1e10
        out_heads = [attention(qh, kh, vh, causal_mask) for qh, kh, vh in zip(*qkv_heads)]
        x = torch.cat(out_heads, dim=-1)
        return self.c_proj(x), present


class FFN(nn.Module):
    def __init__(self, n_embd):
        super().__init__()
        self.c_fc = Dense(n_embd, 4 * n_embd)
        self.c_proj = Dense(4 * n_embd, n_embd)

    def forward(self, x):
        return self.c_proj(gelu(self.c_fc(x)))


class TransformerBlock(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln_1 = Norm(n_embd)
        self.attn = MHA(n_embd, n_head)
        self.ln_2 = Norm(n_embd)
        self.mlp = FFN(n_embd)

    def forward(self, x, past=None):
        a, present = self.attn(self.ln_1(x), past)
        x = x + a
        x = x + self.mlp(self.ln_2(x))
        return x, present


@dataclass
class GPTOutput:
    logits: torch.Tensor
    past_key_values: Optional[Tuple] = None


class GPT2(nn.Module):
    def __init__(self, hparams):
        super().__init__()
        self.hparams = dict(hparams)
        self.wte = nn.Parameter(torch.randn(hparams["n_vocab"], hparams["n_embd"]) * 0.5)
        self.wpe = nn.Parameter(torch.randn(hparams["n_ctx"], hparams["n_embd"]) * 0.3)
        self.blocks = nn.ModuleList(
            [
                TransformerBlock(hparams["n_embd"], hparams["n_head"])
                for _ in range(hparams["n_layer"])
            ]
        )
        self.ln_f = Norm(hparams["n_embd"])

    def forward(self, inputs, past_key_values=None, use_cache=False):
        offset = 0 if past_key_values is None else past_key_values[0][0].shape[1]
        n = inputs.shape[1]
        x = self.wte[inputs] + self.wpe[offset : offset + n]
        presents = []
        for i, block in enumerate(self.blocks):
            x, present = block(x, None if past_key_values is None else past_key_values[i])
            presents.append(present)
        x = self.ln_f(x)
        logits = x @ self.wte.T
        return GPTOutput(logits=logits, past_key_values=tuple(presents) if use_cache else None)


def make_model():
    torch.manual_seed(702)
    model = GPT2(HPARAMS)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, Norm):
                m.g.copy_(1.0 + 0.3 * torch.randn_like(m.g))
                m.b.copy_(0.1 * torch.randn_like(m.b))
    return model.eval()

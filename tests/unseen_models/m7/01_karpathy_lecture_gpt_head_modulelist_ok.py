"""Karpathy's "Let's build GPT" lecture model (gpt.py), with a per-Head key/value cache.

Each attention head is its own module (key/query/value Linear without bias, a tril buffer); the
MultiHeadAttention module holds them in a ModuleList, concatenates their outputs and applies proj.
Blocks live in an nn.Sequential.  The lecture has no cache; this copy gives every Head its own
cache_k/cache_v tensors that grow by torch.cat, and the model a current_pos counter for the
position table (book-buffers: reset_kv_cache(), then model(ids, use_cache=True)).
"""

import torch
import torch.nn as nn
from torch.nn import functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": ["blocks.0.sa", "blocks.1.sa", "blocks.2.sa"],
    "kind": "causal-multihead",
    "cache": "book-buffers",
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
    "style": "Let's-build-GPT lecture gpt.py: Head modules (key/query/value, tril buffer) in a ModuleList inside "
    "MultiHeadAttention with proj, nn.Sequential blocks, wei = q @ k^T * head_size**-0.5; per-Head cat-grown cache",
}

vocab_size = 96
n_embd = 64
n_head = 4
n_layer = 3
block_size = 64


class Head(nn.Module):
    """one head of self-attention"""

    def __init__(self, head_size):
        super().__init__()
        self.key = nn.Linear(n_embd, head_size, bias=False)
        self.query = nn.Linear(n_embd, head_size, bias=False)
        self.value = nn.Linear(n_embd, head_size, bias=False)
        self.register_buffer("tril", torch.tril(torch.ones(block_size, block_size)))
        self.cache_k = None
        self.cache_v = None

    def forward(self, x, use_cache=False):
        B, T, C = x.shape
        k = self.key(x)
        q = self.query(x)
        v = self.value(x)
        if use_cache:
            if self.cache_k is None:
                self.cache_k, self.cache_v = k, v
            else:
                self.cache_k = torch.cat([self.cache_k, k], dim=1)
                self.cache_v = torch.cat([self.cache_v, v], dim=1)
            k, v = self.cache_k, self.cache_v
        Tk = k.shape[1]
        wei = q @ k.transpose(-2, -1) * k.shape[-1] ** -0.5
        wei = wei.masked_fill(self.tril[Tk - T : Tk, :Tk] == 0, float("-inf"))
        wei = F.softmax(wei, dim=-1)
        out = wei @ v
        return out


class MultiHeadAttention(nn.Module):
    """multiple heads of self-attention in parallel"""

    def __init__(self, num_heads, head_size):
        super().__init__()
        self.heads = nn.ModuleList([Head(head_size) for _ in range(num_heads)])
        self.proj = nn.Linear(head_size * num_heads, n_embd)

    def forward(self, x, use_cache=False):
        out = torch.cat([h(x, use_cache) for h in self.heads], dim=-1)
        out = self.proj(out)
        return out


class FeedFoward(nn.Module):
    def __init__(self, n_embd):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd), nn.ReLU(), nn.Linear(4 * n_embd, n_embd)
        )

    def forward(self, x):
        return self.net(x)


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        head_size = n_embd // n_head
        self.sa = MultiHeadAttention(n_head, head_size)
        self.ffwd = FeedFoward(n_embd)
        self.ln1 = nn.LayerNorm(n_embd)
        self.ln2 = nn.LayerNorm(n_embd)

    def forward(self, x, use_cache=False):
        x = x + self.sa(self.ln1(x), use_cache)
        x = x + self.ffwd(self.ln2(x))
        return x


class GPTLanguageModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.token_embedding_table = nn.Embedding(vocab_size, n_embd)
        self.position_embedding_table = nn.Embedding(block_size, n_embd)
        self.blocks = nn.Sequential(*[Block(n_embd, n_head=n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size)
        self.current_pos = 0
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.08)
            if module.bias is not None:
                torch.nn.init.normal_(module.bias, std=0.02)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.5)

    def reset_kv_cache(self):
        for block in self.blocks:
            for h in block.sa.heads:
                h.cache_k = None
                h.cache_v = None
        self.current_pos = 0

    def forward(self, idx, targets=None, use_cache=False):
        B, T = idx.shape
        tok_emb = self.token_embedding_table(idx)
        if use_cache:
            pos = torch.arange(self.current_pos, self.current_pos + T, device=idx.device)
            self.current_pos += T
        else:
            pos = torch.arange(T, device=idx.device)
        x = tok_emb + self.position_embedding_table(pos)
        for block in self.blocks:
            x = block(x, use_cache)
        x = self.ln_f(x)
        logits = self.lm_head(x)
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits.view(B * T, -1), targets.view(B * T))


def make_model():
    torch.manual_seed(701)
    model = GPTLanguageModel()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn_like(m.weight))
                m.bias.copy_(0.1 * torch.randn_like(m.bias))
    return model.eval()

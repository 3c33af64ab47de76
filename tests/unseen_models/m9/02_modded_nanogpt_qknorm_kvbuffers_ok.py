"""KellerJordan/modded-nanogpt speedrun GPT (train_gpt.py) with a bolted-on inference KV cache
(small, random weights).

GPT: embed, blocks.N (Block: attn, mlp), lm_head (CastedLinear), scalar `lambdas` mixing the
embedding x0 back into each block's stream (x = lambdas[i][0] * x + lambdas[i][1] * x0).  Block
norms are F.rms_norm without gains.  CausalSelfAttention: one fused `qkv_w` parameter of shape
(3, heads * head_dim, dim) used through F.linear(x, qkv_w.flatten(end_dim=1)), MHA 4 heads,
per-head QK RMSNorm (`q_norm` / `k_norm`, nn.RMSNorm with gains) before the rotary, `Rotary` with
the speedrun's frequencies (1/1024)**linspace(0, 1, head_dim/4) followed by head_dim/4 zero
frequencies (half the pairs are never rotated), pairs are halves (x1 = x[..., :d/2], x2 = x[..., d/2:]),
float32 cos/sin buffers (rotating counter-clockwise, the usual RoPE direction), then SDPA-like attention with 1/sqrt(head_dim) and a boolean causal mask.
MLP: c_fc -> relu^2 -> c_proj.
Cache: book-buffers: `model.reset_kv_cache()`, `model(prompt, use_cache=True)`,
`model(tok, use_cache=True)`; each `attn` grows `cache_k` / `cache_v` (b, h, s, d) with torch.cat
and the model's `current_pos` gives the positions.  `model(ids)` is the full forward and touches no
cache.  Returns the logits tensor.  Correct everywhere.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": [
        "blocks.0.attn",
        "blocks.1.attn",
        "blocks.2.attn",
    ],
    "kind": "causal-multihead",
    "cache": "book-buffers",
    "structure": {"heads": 4, "kv_heads": 4, "head_dim": 16, "causal": True, "cross": False,
                  "rope": {"pairing": "halves", "fraction": 1.0, "base": None},
                  "qk_norm": "per-head", "window": None, "bias": None},
    "style": "modded-nanogpt train_gpt.py: fused qkv_w (3, hdim, dim), per-head QK RMSNorm before rotary, speedrun "
    "Rotary with half the frequencies zero, x0 lambdas, relu^2 MLP, cache_k/cache_v grown by cat + current_pos",
}


def norm(x):
    return F.rms_norm(x, (x.size(-1),))


class CastedLinear(nn.Linear):
    def __init__(self, in_features, out_features):
        super().__init__(in_features, out_features, bias=False)


class Rotary(nn.Module):
    def __init__(self, dim, max_seq_len):
        super().__init__()
        angular_freq = (1 / 1024) ** torch.linspace(0, 1, steps=dim // 4, dtype=torch.float32)
        angular_freq = torch.cat([angular_freq, angular_freq.new_zeros(dim // 4)])
        t = torch.arange(max_seq_len, dtype=torch.float32)
        theta = torch.einsum("i,j -> ij", t, angular_freq)
        self.register_buffer("cos", theta.cos(), persistent=False)
        self.register_buffer("sin", theta.sin(), persistent=False)

    def forward(self, x_BTHD, offset=0):
        T = x_BTHD.size(-3)
        cos = self.cos[None, offset : offset + T, None, :].type_as(x_BTHD)
        sin = self.sin[None, offset : offset + T, None, :].type_as(x_BTHD)
        x1, x2 = x_BTHD.chunk(2, dim=-1)
        y1 = x1 * cos - x2 * sin
        y2 = x1 * sin + x2 * cos
        return torch.cat((y1, y2), -1).type_as(x_BTHD)


class CausalSelfAttention(nn.Module):
    def __init__(self, dim, num_heads, max_seq_len, head_dim):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        hdim = num_heads * head_dim
        std = 0.5 * dim**-0.5
        bound = (3**0.5) * std
        self.qkv_w = nn.Parameter(torch.empty(3, hdim, dim).uniform_(-bound, bound))
        self.q_norm = nn.RMSNorm(head_dim, eps=1e-6)
        self.k_norm = nn.RMSNorm(head_dim, eps=1e-6)
        self.rotary = Rotary(head_dim, max_seq_len)
        self.c_proj = CastedLinear(hdim, dim)
        self.cache_k = None
        self.cache_v = None

    def forward(self, x, offset=0, use_cache=False):
        B, T = x.size(0), x.size(1)
        q, k, v = F.linear(x, self.qkv_w.flatten(end_dim=1).type_as(x)).view(
            B, T, 3 * self.num_heads, self.head_dim).chunk(3, dim=-2)
        q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(q, offset), self.rotary(k, offset)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if use_cache:
            if self.cache_k is not None:
                k = torch.cat([self.cache_k, k], dim=2)
                v = torch.cat([self.cache_v, v], dim=2)
            self.cache_k, self.cache_v = k, v
        S = k.size(2)
        allowed = torch.ones(T, S, dtype=torch.bool, device=x.device).tril(S - T)
        att = (q @ k.transpose(-2, -1)) * (1.0 / self.head_dim**0.5)
        att = att.masked_fill(~allowed, float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        y = y.transpose(1, 2).contiguous().view(B, T, self.num_heads * self.head_dim)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.c_fc = CastedLinear(dim, 4 * dim)
        self.c_proj = CastedLinear(4 * dim, dim)

    def forward(self, x):
        return self.c_proj(F.relu(self.c_fc(x)).square())


class Block(nn.Module):
    def __init__(self, dim, num_heads, max_seq_len):
        super().__init__()
        self.attn = CausalSelfAttention(dim, num_heads, max_seq_len, dim // num_heads)
        self.mlp = MLP(dim)

    def forward(self, x, x0, lambdas, offset, use_cache):
        x = lambdas[0] * x + lambdas[1] * x0
        x = x + self.attn(norm(x), offset=offset, use_cache=use_cache)
        return x + self.mlp(norm(x))


class GPT(nn.Module):
    def __init__(self, vocab_size, num_layers, num_heads, model_dim, max_seq_len):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, model_dim)
        self.blocks = nn.ModuleList([Block(model_dim, num_heads, max_seq_len) for _ in range(num_layers)])
        self.lm_head = CastedLinear(model_dim, vocab_size)
        self.lambdas = nn.Parameter(torch.tensor([[1.0, 0.0]] * num_layers))
        self.current_pos = 0

    def reset_kv_cache(self):
        for block in self.blocks:
            block.attn.cache_k = None
            block.attn.cache_v = None
        self.current_pos = 0

    def forward(self, input_seq, use_cache=False):
        offset = self.current_pos if use_cache else 0
        x = x0 = norm(self.embed(input_seq))
        for i, block in enumerate(self.blocks):
            x = block(x, x0, self.lambdas[i], offset, use_cache)
        if use_cache:
            self.current_pos += input_seq.size(1)
        x = norm(x)
        logits = self.lm_head(x)
        return 30 * torch.sigmoid(logits / 7.5)


def make_model():
    torch.manual_seed(902)
    model = GPT(vocab_size=128, num_layers=3, num_heads=4, model_dim=64, max_seq_len=128)
    g = torch.Generator().manual_seed(9021)
    with torch.no_grad():
        model.lambdas.copy_(torch.tensor([[1.0, 0.0], [0.8, 0.3], [0.9, 0.2]]))
        for m in model.modules():
            if isinstance(m, nn.RMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
        for block in model.blocks:
            block.attn.c_proj.weight.normal_(0.0, 0.1, generator=g)
    return model.eval()

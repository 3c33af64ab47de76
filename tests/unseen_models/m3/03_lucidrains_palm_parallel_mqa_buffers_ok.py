"""A tiny PaLM in the style of lucidrains' PaLM-pytorch, with attention split into its own module.

PaLM: token_emb -> nn.Sequential of Residual(ParallelTransformerBlock) -> LayerNorm -> tied logits.
Parallel block: one LayerNorm (gamma parameter, beta a zero buffer), attention and SwiGLU
feed-forward both read the same normed x and are summed.  Multi-query attention: to_q gives 4
heads of 16, to_kv one shared key/value head; queries scaled by dim_head ** -0.5 before the
rotary (halves layout, freqs cat(freqs, freqs)); einsum 'b h i d, b j d -> b h i j'; causal
mask by masked_fill(-finfo.max); attn_out Linear without bias.

Cache (book-buffers): model.reset_kv_cache(); model(prompt, use_cache=True); model(tok,
use_cache=True).  Each attention keeps cache_k / cache_v grown by torch.cat; model.current_pos
offsets the rotary positions and the mask.  Correct.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": ["net.0.fn.attn", "net.1.fn.attn", "net.2.fn.attn"],
    "kind": "causal-multihead",
    "cache": "book-buffers",
    "structure": {
        "heads": 4,
        "kv_heads": 1,
        "head_dim": 16,
        "causal": True,
        "rope": {"pairing": "half", "fraction": 1.0, "base": 10000.0},
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "lucidrains PaLM-pytorch: Residual(ParallelTransformerBlock) in nn.Sequential, MQA einsum, "
    "scale before rotary, SwiGLU parallel ff, LayerNorm with beta buffer; cat-grown cache buffers",
}


class LayerNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(dim))
        self.register_buffer("beta", torch.zeros(dim))

    def forward(self, x):
        return F.layer_norm(x, x.shape[-1:], self.gamma, self.beta)


class Residual(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x, **kwargs):
        return self.fn(x, **kwargs) + x


class RotaryEmbedding(nn.Module):
    def __init__(self, dim):
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq)

    def forward(self, positions):
        freqs = torch.einsum("i , j -> i j", positions.type(self.inv_freq.dtype), self.inv_freq)
        return torch.cat((freqs, freqs), dim=-1)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(pos, t):
    return (t * pos.cos()) + (rotate_half(t) * pos.sin())


class MQAttention(nn.Module):
    def __init__(self, dim, dim_head=16, heads=4):
        super().__init__()
        self.heads = heads
        self.dim_head = dim_head
        self.scale = dim_head**-0.5
        self.to_q = nn.Linear(dim, dim_head * heads, bias=False)
        self.to_kv = nn.Linear(dim, dim_head * 2, bias=False)
        self.attn_out = nn.Linear(dim_head * heads, dim, bias=False)
        self.rotary_emb = RotaryEmbedding(dim_head)
        self.cache_k = None
        self.cache_v = None

    def reset_cache(self):
        self.cache_k, self.cache_v = None, None

    def forward(self, x, start_pos=0, use_cache=False):
        b, n, _ = x.shape
        h = self.heads
        q = self.to_q(x).view(b, n, h, self.dim_head).transpose(1, 2)  # b h n d
        k, v = self.to_kv(x).chunk(2, dim=-1)  # b n d (single head)
        positions = torch.arange(start_pos, start_pos + n, device=x.device)
        pos_emb = self.rotary_emb(positions)
        q = q * self.scale
        q, k = map(lambda t: apply_rotary_pos_emb(pos_emb, t), (q, k))
        if use_cache:
            if self.cache_k is not None:
                k = torch.cat((self.cache_k, k), dim=1)
                v = torch.cat((self.cache_v, v), dim=1)
            self.cache_k, self.cache_v = k, v
        sim = torch.einsum("b h i d, b j d -> b h i j", q, k)
        j = k.shape[1]
        causal_mask = torch.ones((n, j), dtype=torch.bool, device=x.device).triu(j - n + 1)
        sim = sim.masked_fill(causal_mask, -torch.finfo(sim.dtype).max)
        attn = sim.softmax(dim=-1)
        out = torch.einsum("b h i j, b j d -> b h i d", attn, v)
        out = out.transpose(1, 2).reshape(b, n, h * self.dim_head)
        return self.attn_out(out)


class SwiGLU(nn.Module):
    def forward(self, x):
        x, gate = x.chunk(2, dim=-1)
        return F.silu(gate) * x


class ParallelTransformerBlock(nn.Module):
    def __init__(self, dim, dim_head=16, heads=4, ff_mult=2):
        super().__init__()
        self.norm = LayerNorm(dim)
        self.attn = MQAttention(dim, dim_head, heads)
        ff_inner = dim * ff_mult
        self.ff_in = nn.Linear(dim, ff_inner * 2, bias=False)
        self.swiglu = SwiGLU()
        self.ff_out = nn.Linear(ff_inner, dim, bias=False)

    def forward(self, x, start_pos=0, use_cache=False):
        x = self.norm(x)
        return self.attn(x, start_pos=start_pos, use_cache=use_cache) + self.ff_out(
            self.swiglu(self.ff_in(x))
        )


class PaLM(nn.Module):
    def __init__(self, num_tokens=128, dim=64, depth=3, dim_head=16, heads=4):
        super().__init__()
        self.token_emb = nn.Embedding(num_tokens, dim)
        self.net = nn.Sequential(
            *[Residual(ParallelTransformerBlock(dim, dim_head, heads)) for _ in range(depth)]
        )
        self.norm = LayerNorm(dim)
        self.to_logits = nn.Linear(dim, num_tokens, bias=False)
        self.to_logits.weight = self.token_emb.weight
        self.current_pos = 0

    def reset_kv_cache(self):
        self.current_pos = 0
        for blk in self.net:
            blk.fn.attn.reset_cache()

    def forward(self, x, use_cache=False):
        n = x.shape[1]
        start_pos = self.current_pos if use_cache else 0
        h = self.token_emb(x)
        for blk in self.net:
            h = blk(h, start_pos=start_pos, use_cache=use_cache)
        if use_cache:
            self.current_pos += n
        return self.to_logits(self.norm(h))


def make_model():
    torch.manual_seed(2)
    model = PaLM()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LayerNorm):
                m.gamma.copy_(1.0 + 0.3 * torch.randn_like(m.gamma))
    return model.eval()

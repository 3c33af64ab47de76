"""A small rotary decoder with sliding-window layers written against attention-gym's mask mods
(pytorch-labs/attention-gym attn_gym/masks/sliding_window.py).

attention-gym's `generate_sliding_window(window_size)` returns `sliding_window_causal(b, h, q_idx,
kv_idx)` = causal_mask & (q_idx - kv_idx <= window_size): a query sees window_size + 1 keys.  The
config here declares `sliding_window = 4` as the number of keys a query sees, itself included (kept on
each windowed attention as `attn.sliding_window`), so the blocks are meant to call
`generate_sliding_window(config.sliding_window - 1)`.  Blocks 0 and 1 are windowed
(`config.window_layers`), block 2 is global (`causal_mask`).  `flex_attention` is a plain-torch
stand-in that evaluates the mask_mod on broadcast index tensors over the dense scores (-inf where
False).  Rotary: rotate_half tables (base 1e4) on q and k before flex_attention.
Tree: decoder.tok_emb, decoder.blocks.N (ln_1, attn [Wqkv, out_proj], ln_2, mlp), decoder.ln_f,
lm_head; MHA 4 heads, 3 blocks.  No cache; returns the logits tensor.
Slip: block 1 was wired with `generate_sliding_window(config.sliding_window)` (the count passed where
attention-gym expects the distance), so its queries see 5 keys instead of the declared 4.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": [
        "decoder.blocks.0.attn",
        "decoder.blocks.1.attn",
        "decoder.blocks.2.attn",
    ],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "decoder.blocks.1.attn",
    "stage": "masked_scores",
    "mistake": "window_size",
    "style": "attention-gym mask_mods: generate_sliding_window / causal_mask evaluated densely by a flex_attention "
    "stand-in, fused Wqkv, rotate_half rotary; declared sliding_window 4 on blocks 0-1, block 2 global; block 1 "
    "built with generate_sliding_window(4) (sees 5 keys)",
}


def causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def generate_sliding_window(window_size):
    def sliding_window(b, h, q_idx, kv_idx):
        return q_idx - kv_idx <= window_size

    def sliding_window_causal(b, h, q_idx, kv_idx):
        return causal_mask(b, h, q_idx, kv_idx) & sliding_window(b, h, q_idx, kv_idx)

    sliding_window_causal.__name__ = f"sliding_window_{window_size}"
    return sliding_window_causal


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rope_tables(head_dim, seq_len, dtype, device, base=10000.0):
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype=dtype, device=device), emb.sin().to(dtype=dtype, device=device)


def flex_attention(query, key, value, score_mod=None, mask_mod=None, scale=None):
    B, H, L, E = query.shape
    S = key.shape[-2]
    scale = 1.0 / math.sqrt(E) if scale is None else scale
    scores = torch.matmul(query, key.transpose(-2, -1)) * scale
    dev = query.device
    b = torch.arange(B, device=dev).view(B, 1, 1, 1)
    h = torch.arange(H, device=dev, dtype=query.dtype).view(1, H, 1, 1)
    q_idx = torch.arange(L, device=dev).view(1, 1, L, 1)
    kv_idx = torch.arange(S, device=dev).view(1, 1, 1, S)
    if score_mod is not None:
        scores = score_mod(scores, b, h, q_idx, kv_idx)
    if mask_mod is not None:
        keep = mask_mod(b, h, q_idx, kv_idx)
        scores = scores.masked_fill(~keep, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    return torch.matmul(weights, value)


class CausalSelfAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.n_head = config.n_head
        self.head_dim = config.d_model // config.n_head
        self.d_model = config.d_model
        self.Wqkv = nn.Linear(config.d_model, 3 * config.d_model, bias=False)
        self.out_proj = nn.Linear(config.d_model, config.d_model, bias=False)
        if layer_idx in config.window_layers:
            self.sliding_window = config.sliding_window
            arg = config.sliding_window if layer_idx in config.count_as_distance_layers else config.sliding_window - 1
            self.mask_mod = generate_sliding_window(arg)
        else:
            self.sliding_window = None
            self.mask_mod = causal_mask

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.Wqkv(x).split(self.d_model, dim=-1)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        cos, sin = rope_tables(self.head_dim, T, x.dtype, x.device)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        y = flex_attention(q, k, v, mask_mod=self.mask_mod)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.out_proj(y)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.fc1 = nn.Linear(config.d_model, 4 * config.d_model)
        self.fc2 = nn.Linear(4 * config.d_model, config.d_model)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Decoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList([Block(config, i) for i in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.d_model)

    def forward(self, idx):
        x = self.tok_emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)


class WindowLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.decoder = Decoder(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)

    def forward(self, idx):
        return self.lm_head(self.decoder(idx))


def make_model():
    torch.manual_seed(2409)
    config = SimpleNamespace(vocab_size=96, d_model=64, n_head=4, n_layer=3, max_seq_len=64,
                             sliding_window=4, window_layers=(0, 1), count_as_distance_layers=(1,))
    model = WindowLM(config)
    g = torch.Generator().manual_seed(24091)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model.eval()

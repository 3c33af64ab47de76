"""mlx-lm's llama.py ported line by line to torch (Module.__call__ -> forward, mx -> torch).

Model -> model (LlamaModel: embed_tokens, layers list, norm) + lm_head.  Attention: q/k/v/o_proj
without bias, GQA 4 query heads / 2 kv heads of 16, nn.RoPE(head_dim, traditional=False,
base=10000) i.e. the halves layout, rotated with an offset; mx.fast.scaled_dot_product_attention
becomes F.scaled_dot_product_attention(enable_gqa=True) with the mask from create_attention_mask
(None on one-token steps, else a causal mask offset by the cache).  mlx-lm's per-layer KVCache
(step-allocated buffers, offset, update_and_fetch) is wrapped in a KVCache(n_layers) container.

Cache (book-cache): cache = mod.KVCache(n_layers=3); model.reset_kv_cache() (no-op);
model(prompt, cache=cache); model(tok, cache=cache).

Slip (decoding only): the model reads the rotary offset from the container's own `offset`
attribute, which nothing advances (only the per-layer caches move theirs), so every call is
rotated from position 0.  The full forward and the prompt pass are exact; the decoded token's
query and key are rotated at position 0 instead of the cache length.  Step 0,
model.layers.0.self_attn: cache_positions.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["model.layers.0.self_attn", "model.layers.1.self_attn", "model.layers.2.self_attn"],
    "kind": "causal-multihead",
    "cache": "book-cache",
    "decode": {"mistake": "cache_positions", "step": 0, "layer": "model.layers.0.self_attn"},
    "style": "mlx-lm models/llama.py ported to torch: nn.RoPE(traditional=False) with offset, step-allocated "
    "KVCache.update_and_fetch, create_attention_mask; slip: offset read from the never-advanced container",
}


class ModelArgs:
    vocab_size = 136
    hidden_size = 64
    num_hidden_layers = 3
    num_attention_heads = 4
    num_key_value_heads = 2
    intermediate_size = 112
    rms_norm_eps = 1e-5
    rope_theta = 10000.0


class _LayerKVCache:
    step = 16

    def __init__(self):
        self.keys = None
        self.values = None
        self.offset = 0

    def update_and_fetch(self, keys, values):
        prev = self.offset
        B, n_kv_heads, S, k_head_dim = keys.shape
        if self.keys is None or (prev + S) > self.keys.shape[2]:
            n_steps = (self.step + S - 1) // self.step
            shape = (B, n_kv_heads, n_steps * self.step, k_head_dim)
            new_k = torch.zeros(shape, dtype=keys.dtype, device=keys.device)
            new_v = torch.zeros(shape, dtype=values.dtype, device=values.device)
            if self.keys is not None:
                self.keys = torch.cat([self.keys[..., :prev, :], new_k], dim=2)
                self.values = torch.cat([self.values[..., :prev, :], new_v], dim=2)
            else:
                self.keys, self.values = new_k, new_v
        self.offset += S
        self.keys[..., prev : self.offset, :] = keys
        self.values[..., prev : self.offset, :] = values
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]


class KVCache:
    """One mlx-lm KVCache per layer, in a list-like container."""

    def __init__(self, n_layers):
        self.layers = [_LayerKVCache() for _ in range(n_layers)]
        self.offset = 0

    def __getitem__(self, i):
        return self.layers[i]

    def __len__(self):
        return len(self.layers)


class RMSNorm(nn.Module):
    def __init__(self, dims, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dims))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class RoPE(nn.Module):
    """mlx.nn.RoPE; traditional=False rotates the two halves of the feature axis."""

    def __init__(self, dims, traditional=False, base=10000.0):
        super().__init__()
        self.dims = dims
        self.traditional = traditional
        self.base = base

    def forward(self, x, offset=0):
        L = x.shape[-2]
        positions = torch.arange(offset, offset + L, dtype=x.dtype, device=x.device)
        inv = self.base ** (
            -torch.arange(0, self.dims, 2, dtype=x.dtype, device=x.device) / self.dims
        )
        theta = positions[:, None] * inv[None, :]
        cos, sin = theta.cos(), theta.sin()
        x1, x2 = x[..., : self.dims // 2], x[..., self.dims // 2 :]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def create_attention_mask(h, cache=None):
    T = h.shape[1]
    if T > 1:
        offset = cache[0].offset if cache is not None else 0
        rinds = torch.arange(offset + T, device=h.device)
        linds = torch.arange(offset, offset + T, device=h.device)
        return linds[:, None] >= rinds[None]  # True = may attend
    return None


class Attention(nn.Module):
    def __init__(self, args):
        super().__init__()
        dim = args.hidden_size
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = dim // self.n_heads
        self.scale = self.head_dim**-0.5
        self.q_proj = nn.Linear(dim, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, dim, bias=False)
        self.rope = RoPE(self.head_dim, traditional=False, base=args.rope_theta)

    def forward(self, x, mask=None, cache=None, offset=0):
        B, L, D = x.shape
        queries = self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(1, 2)
        keys = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(1, 2)
        values = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(1, 2)
        queries = self.rope(queries, offset=offset)
        keys = self.rope(keys, offset=offset)
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)
        output = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=mask, scale=self.scale, enable_gqa=True
        )
        output = output.transpose(1, 2).reshape(B, L, -1)
        return self.o_proj(output)


class MLP(nn.Module):
    def __init__(self, dim, hidden_dim):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TransformerBlock(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def forward(self, x, mask=None, cache=None, offset=0):
        h = x + self.self_attn(self.input_layernorm(x), mask, cache, offset)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList([TransformerBlock(args) for _ in range(args.num_hidden_layers)])
        self.norm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def forward(self, inputs, cache=None):
        h = self.embed_tokens(inputs)
        mask = create_attention_mask(h, cache)
        offset = cache.offset if cache is not None else 0  # SLIP
        if cache is None:
            cache = [None] * len(self.layers)
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask, cache=c, offset=offset)
        return self.norm(h)


class Model(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.model = LlamaModel(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def reset_kv_cache(self):
        pass

    def forward(self, inputs, cache=None):
        return self.lm_head(self.model(inputs, cache))


def make_model():
    torch.manual_seed(12)
    model = Model(ModelArgs())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(1.0 + 0.25 * torch.randn_like(m.weight))
    return model.eval()

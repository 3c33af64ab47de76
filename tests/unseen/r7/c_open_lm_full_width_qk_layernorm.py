"""open_lm-style block: in_proj chunked into q, k, v; gain-only LayerNorm over the full query/key width
(all heads together) before the heads are split; xformers-like rotary (half pairing) with (b, s, h, d) tensors."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


class LayerNorm(nn.Module):
    """LayerNorm with switchable gain and bias, as in open_lm/norms.py."""

    def __init__(self, normalized_shape, eps=1e-5, elementwise_gain=True, elementwise_bias=True):
        super().__init__()
        self.normalized_shape = (
            (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        )
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(self.normalized_shape)) if elementwise_gain else None
        self.bias = nn.Parameter(torch.zeros(self.normalized_shape)) if elementwise_bias else None

    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


def get_norm_class(model_norm):
    if model_norm == "default_layer_norm":
        return nn.LayerNorm
    if model_norm == "gain_only_layer_norm":
        return lambda dim, eps=1e-5: LayerNorm(
            dim, eps=eps, elementwise_gain=True, elementwise_bias=False
        )
    if model_norm == "no_wb_layer_norm":
        return lambda dim, eps=1e-5: LayerNorm(
            dim, eps=eps, elementwise_gain=False, elementwise_bias=False
        )
    raise ValueError(f"Unsupported model-norm: {model_norm}")


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(x, cos, sin, offset=0):
    # x: (b, s, h, d); cos/sin: (1, max_s, 1, d)
    cos = cos[:, offset : offset + x.shape[1], :, :]
    sin = sin[:, offset : offset + x.shape[1], :, :]
    return (x * cos) + (rotate_half(x) * sin)


class RotaryEmbedding(nn.Module):
    """Sequence dimension is 1 (b, s, h, d)."""

    def __init__(self, dim_model, seq_len, frequency=10000):
        super().__init__()
        self.dim_model = dim_model
        self.frequency = frequency
        self.register_buffer("inv_freq", torch.zeros(self.dim_model // 2), persistent=False)
        self._cos_cached = None
        self._sin_cached = None
        self._seq_len_cached = 0
        self.reset_parameters(seq_len)

    def reset_parameters(self, seq_len):
        with torch.no_grad():
            self.inv_freq.copy_(
                1.0
                / (
                    self.frequency
                    ** (torch.arange(0, self.dim_model, 2, dtype=torch.float64) / self.dim_model)
                )
            )
        self._update_cos_sin_tables(seq_len)

    def _update_cos_sin_tables(self, seq_len, device=None, dtype=None):
        if (
            seq_len > self._seq_len_cached
            or self._cos_cached is None
            or (dtype is not None and self._cos_cached.dtype != dtype)
        ):
            self._seq_len_cached = max(seq_len, self._seq_len_cached)
            t = torch.arange(self._seq_len_cached, dtype=torch.float64)
            freqs = torch.einsum("i,j->ij", t, self.inv_freq.to(torch.float64))
            emb = torch.cat((freqs, freqs), dim=-1)
            dtype = dtype or torch.float32
            self._cos_cached = emb.cos()[None, :, None, :].to(dtype)
            self._sin_cached = emb.sin()[None, :, None, :].to(dtype)

    def forward(self, q, k, offset=0):
        self._update_cos_sin_tables(k.shape[1] + offset, device=k.device, dtype=k.dtype)
        return (
            apply_rotary_pos_emb(q, self._cos_cached, self._sin_cached, offset),
            apply_rotary_pos_emb(k, self._cos_cached, self._sin_cached, offset),
        )


class RotaryWithCast(RotaryEmbedding):
    def forward(self, q, k, v, offset=0):
        q, k = super().forward(q, k, offset)
        return q.to(v.dtype), k.to(v.dtype), v


def torch_attn(queries, keys, values, is_causal, attention_mask=None):
    # queries/keys/values: (b, s, h, d)
    out = F.scaled_dot_product_attention(
        queries.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), is_causal=is_causal
    )
    return out.transpose(1, 2).contiguous()


@dataclass
class Params:
    dim: int = 64
    n_layers: int = 1
    n_heads: int = 4
    seq_len: int = 64
    norm_eps: float = 1e-5
    apply_qk_norm: bool = True
    model_norm: str = "gain_only_layer_norm"


class CustomAttn(nn.Module):
    def __init__(self, layer_id, args):
        super().__init__()
        self.n_heads = args.n_heads
        self.head_dim = args.dim // args.n_heads
        self.in_proj = nn.Linear(args.dim, 3 * args.n_heads * self.head_dim, bias=False)
        self.out_proj = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.pos_embed = RotaryWithCast(self.head_dim, args.seq_len)
        self.attn_fn = torch_attn
        self.apply_qk_norm = args.apply_qk_norm
        norm_type = get_norm_class(args.model_norm)
        self.q_norm = (
            norm_type(args.n_heads * self.head_dim, eps=args.norm_eps)
            if self.apply_qk_norm
            else nn.Identity()
        )
        self.k_norm = (
            norm_type(args.n_heads * self.head_dim, eps=args.norm_eps)
            if self.apply_qk_norm
            else nn.Identity()
        )
        self.layer_id = layer_id

    def forward(self, x, is_causal=True, past_key_value=None, use_cache=False):
        batchsize, q_len, _ = x.shape
        queries, keys, vals = self.in_proj(x).chunk(3, dim=-1)
        queries = self.q_norm(queries)
        keys = self.k_norm(keys)
        queries = queries.view(batchsize, q_len, self.n_heads, self.head_dim)
        keys = keys.view(batchsize, q_len, self.n_heads, self.head_dim)
        vals = vals.view(batchsize, q_len, self.n_heads, self.head_dim)
        past_length = 0 if past_key_value is None else past_key_value[0].shape[1]
        queries, keys, vals = self.pos_embed(queries, keys, vals, offset=past_length)
        output = self.attn_fn(queries, keys, vals, is_causal=is_causal)
        output = output.view(batchsize, q_len, -1)
        return self.out_proj(output), past_key_value


class SwiGLU(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w12 = nn.Linear(dim, 2 * hidden, bias=False)
        self.w3 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        x1, x2 = self.w12(x).chunk(2, dim=-1)
        return self.w3(F.silu(x1) * x2)


class Block(nn.Module):
    def __init__(self, layer_id, args):
        super().__init__()
        self.attention = CustomAttn(layer_id, args)
        self.feed_forward = SwiGLU(args.dim, 2 * args.dim)
        norm_type = get_norm_class(args.model_norm)
        self.attention_norm = norm_type(args.dim, eps=args.norm_eps)
        self.ffn_norm = norm_type(args.dim, eps=args.norm_eps)

    def forward(self, x):
        h, _ = self.attention(self.attention_norm(x), is_causal=True)
        h = x + h
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, params):
        super().__init__()
        self.params = params
        self.layers = nn.ModuleList([Block(i, params) for i in range(params.n_layers)])
        self.norm = get_norm_class(params.model_norm)(params.dim, eps=params.norm_eps)

    def forward(self, inputs_embeds):
        x = inputs_embeds
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


def make_open_lm():
    model = Transformer(Params())
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        attn = model.layers[0].attention
        attn.q_norm.weight.copy_(0.5 + torch.rand(64, generator=g))
        attn.k_norm.weight.copy_(0.5 + torch.rand(64, generator=g))
    return model


EXPECT = {
    "target": "make_open_lm",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "layers.0.attention",
    "structure": {
        "heads": 4,
        "kv_heads": 4,
        "head_dim": 16,
        "causal": True,
        "cross": False,
        "rope": {"pairing": "half", "fraction": 1.0, "base": 10000},
        "qk_norm": "full",
        "window": None,
        "bias": None,
    },
    "style": "open_lm CustomAttn (in_proj.chunk(3), q_norm/k_norm = gain-only LayerNorm(n_heads * head_dim) before the head split, RotaryWithCast on (b, s, h, d), torch_attn SDPA is_causal)",
}

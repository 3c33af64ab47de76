"""mlfoundations/open_lm (the DCLM training code), open_lm/model.py, small config with qk_norm.

Transformer: tok_embeddings, layers.N (Block: attention_norm -> attention -> + residual, ffn_norm ->
feed_forward (SwiGLU w12 fused (gate | up) and w3) -> + residual), norm, output.  Norms are open_lm's
"gain_only_lp_layer_norm": LayerNorm with a gain and no bias.  CustomAttn: one fused `in_proj`
(q | k | v, no bias) chunked in three, q_norm / k_norm = gain-only LayerNorms over the *whole* query and
key projections (before the head view), RotaryWithCast (halves, base 1e4) applied on the (b, s, h, d)
layout with `offset` = cached length, MHA (4 heads), attention through SDPA with is_causal on the
prompt and an explicit boolean mask when a past exists, `out_proj`.
Cache: hf, a tuple of per-layer (k, v) tuples in (b, s, heads, d) concatenated on dim 1:
`out = model(ids, use_cache=True)`, then `model(tok, past_key_values=out.past_key_values,
use_cache=True)`; `out.logits`.  (open_lm's own forward returns (logits, hidden, past); the wrapper
object carries the same three.)
Correct.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": ["layers.0.attention", "layers.1.attention", "layers.2.attention"],
    "kind": "causal-multihead",
    "cache": "hf",
    "style": "open_lm (DCLM) model.py: fused in_proj chunked q|k|v, full-projection gain-only LayerNorm q_norm/k_norm, "
    "RotaryWithCast halves with offset, (b, s, h, d) tuple cache cat on dim 1, SwiGLU w12/w3, gain-only LayerNorms",
}


class LayerNormGainOnly(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return F.layer_norm(x, (x.shape[-1],), self.weight, None, self.eps)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryWithCast(nn.Module):
    def __init__(self, dim_model, seq_len=64, base=10000.0):
        super().__init__()
        self.dim_model = dim_model
        self.base = base
        self.register_buffer("inv_freq", 1.0 / (base ** (torch.arange(0, dim_model, 2, dtype=torch.float64) / dim_model)),
                             persistent=False)

    def _cos_sin(self, seq_len, device, dtype):
        t = torch.arange(seq_len, device=device, dtype=torch.float64)
        freqs = torch.einsum("i,j->ij", t, self.inv_freq.to(torch.float64))
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos()[None, :, None, :].to(dtype), emb.sin()[None, :, None, :].to(dtype)

    def forward(self, q, k, v, offset=0):
        seq_len = q.shape[1]
        cos, sin = self._cos_sin(offset + seq_len, q.device, q.dtype)
        cos, sin = cos[:, offset:], sin[:, offset:]
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v


class CustomAttn(nn.Module):
    def __init__(self, layer_id, args):
        super().__init__()
        self.n_heads = args.n_heads
        self.head_dim = args.dim // args.n_heads
        self.in_proj = nn.Linear(args.dim, 3 * args.n_heads * self.head_dim, bias=False)
        self.out_proj = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.pos_embed = RotaryWithCast(self.head_dim, args.seq_len)
        self.layer_id = layer_id
        self.apply_qk_norm = args.apply_qk_norm
        self.q_norm = LayerNormGainOnly(args.n_heads * self.head_dim, eps=args.norm_eps) if args.apply_qk_norm else nn.Identity()
        self.k_norm = LayerNormGainOnly(args.n_heads * self.head_dim, eps=args.norm_eps) if args.apply_qk_norm else nn.Identity()

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
        if past_key_value is not None and use_cache:
            keys = torch.cat([past_key_value[0], keys], dim=1)
            vals = torch.cat([past_key_value[1], vals], dim=1)
        if use_cache:
            past_key_value = [keys, vals]
        q, k, v = queries.transpose(1, 2), keys.transpose(1, 2), vals.transpose(1, 2)
        if past_length == 0:
            output = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
        else:
            kv_len = k.shape[2]
            rows = past_length + torch.arange(q_len, device=x.device)
            allowed = torch.arange(kv_len, device=x.device)[None, :] <= rows[:, None]
            output = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[None, None])
        output = output.transpose(1, 2).contiguous().view(batchsize, q_len, -1)
        return self.out_proj(output), past_key_value


class SwiGLU(nn.Module):
    def __init__(self, in_features, hidden_features, out_features):
        super().__init__()
        self.w12 = nn.Linear(in_features, 2 * hidden_features, bias=False)
        self.w3 = nn.Linear(hidden_features, out_features, bias=False)

    def forward(self, x):
        x1, x2 = self.w12(x).chunk(2, dim=-1)
        return self.w3(F.silu(x1) * x2)


class Block(nn.Module):
    def __init__(self, layer_id, args):
        super().__init__()
        self.attention = CustomAttn(layer_id, args)
        self.feed_forward = SwiGLU(args.dim, args.hidden_dim, args.dim)
        self.attention_norm = LayerNormGainOnly(args.dim, eps=args.norm_eps)
        self.ffn_norm = LayerNormGainOnly(args.dim, eps=args.norm_eps)

    def forward(self, x, past_key_value=None, use_cache=False):
        h, past_key_value = self.attention(self.attention_norm(x), is_causal=True, past_key_value=past_key_value,
                                           use_cache=use_cache)
        h = x + h
        return h + self.feed_forward(self.ffn_norm(h)), past_key_value


class Transformer(nn.Module):
    def __init__(self, params):
        super().__init__()
        self.params = params
        self.tok_embeddings = nn.Embedding(params.vocab_size, params.dim)
        self.layers = nn.ModuleList([Block(i, params) for i in range(params.n_layers)])
        self.norm = LayerNormGainOnly(params.dim, eps=params.norm_eps)
        self.output = nn.Linear(params.dim, params.vocab_size, bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        x = self.tok_embeddings(input_ids)
        if past_key_values is None:
            past_key_values = [None] * len(self.layers)
        elif isinstance(past_key_values, tuple):
            past_key_values = list(past_key_values)
        for i, layer in enumerate(self.layers):
            x, past_key_values[i] = layer(x, past_key_value=past_key_values[i], use_cache=use_cache)
        if not use_cache:
            past_key_values = None
        x = self.norm(x)
        output = self.output(x)
        past = tuple(tuple(p) for p in past_key_values) if past_key_values is not None else None
        return SimpleNamespace(logits=output, hidden_states=x, past_key_values=past)


def make_model():
    torch.manual_seed(0)
    params = SimpleNamespace(dim=64, n_layers=3, n_heads=4, vocab_size=128, hidden_dim=128, norm_eps=1e-5,
                             seq_len=64, apply_qk_norm=True)
    model = Transformer(params)
    for m in model.modules():
        if isinstance(m, LayerNormGainOnly):
            nn.init.uniform_(m.weight, 0.6, 1.4)
    return model.eval()

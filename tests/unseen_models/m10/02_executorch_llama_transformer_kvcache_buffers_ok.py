"""ExecuTorch's examples/models/llama/llama_transformer.py (eager export model), kept to its module tree.

Transformer: tok_embeddings, layers.N (TransformerBlock: attention_norm, attention, ffn_norm,
feed_forward w1/w2/w3), norm, output.  Attention (AttentionMHA): wq/wk/wv/wo without bias, GQA 6/2
by repeat_interleave on the head axis, real-valued interleaved rotary (`hf_apply_rotary_emb` is *not*
used: the cos/sin tables are per pair and applied to (x[..., 0::2], x[..., 1::2])), base 1e4,
a `KVCache` submodule per attention holding `k_cache`/`v_cache` buffers (b, kv_heads, 64, d) written
with index_put at `input_pos`, and a model-level `mask` buffer (64 x 64, -inf above the diagonal)
whose rows are selected by `input_pos`; attention via F.scaled_dot_product_attention with that mask.
Cache: book-buffers.  Either `model.reset_kv_cache(); model(prompt, use_cache=True); model(tok,
use_cache=True)` (position tracked in model.current_pos), or Meta-style `model(tokens, start_pos)`
(start_pos=0 resets).  Buffers hold batch <= 4, 64 positions.  Returns a logits tensor.
Correct.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from dataclasses import dataclass

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": ["layers.0.attention", "layers.1.attention", "layers.2.attention"],
    "kind": "causal-multihead",
    "cache": "book-buffers",
    "style": "ExecuTorch llama_transformer.py: ModelArgs dataclass, KVCache submodule with k_cache/v_cache index_put at "
    "input_pos, model-level mask rows by input_pos, real interleaved rotary, GQA 6/2 repeat_interleave, SDPA with "
    "explicit mask; start_pos or use_cache",
}


@dataclass
class ModelArgs:
    dim: int = 96
    n_layers: int = 3
    n_heads: int = 6
    n_kv_heads: int = 2
    vocab_size: int = 128
    hidden_dim: int = 160
    norm_eps: float = 1e-5
    max_batch_size: int = 4
    max_seq_len: int = 64
    rope_freq_base: float = 10000.0


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def precompute_freqs(dim, end, theta):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64)[: dim // 2] / dim))
    t = torch.arange(end, dtype=torch.float64)
    freqs = torch.outer(t, freqs)
    return torch.cos(freqs), torch.sin(freqs)


def apply_rotary_emb(x, freqs_cos, freqs_sin):
    # x: (b, s, h, d); tables (s, d/2)
    x_r, x_i = x[..., 0::2], x[..., 1::2]
    cos = freqs_cos[None, :, None, :].to(x.dtype)
    sin = freqs_sin[None, :, None, :].to(x.dtype)
    out_r = x_r * cos - x_i * sin
    out_i = x_r * sin + x_i * cos
    return torch.stack([out_r, out_i], dim=-1).flatten(3)


class KVCache(nn.Module):
    def __init__(self, max_batch_size, max_seq_length, n_heads, head_dim):
        super().__init__()
        shape = (max_batch_size, n_heads, max_seq_length, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape), persistent=False)

    def update(self, input_pos, k_val, v_val):
        bsz = k_val.shape[0]
        self.k_cache[:bsz, :, input_pos] = k_val
        self.v_cache[:bsz, :, input_pos] = v_val
        return self.k_cache[:bsz], self.v_cache[:bsz]


class Attention(nn.Module):
    def __init__(self, args, layer_id):
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.n_rep = self.n_heads // self.n_kv_heads
        self.head_dim = args.dim // args.n_heads
        self.layer_id = layer_id
        self.wq = nn.Linear(args.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, args.dim, bias=False)
        self.kv_cache = KVCache(args.max_batch_size, args.max_seq_len, self.n_kv_heads, self.head_dim)

    def forward(self, x, freqs_cos, freqs_sin, mask, input_pos=None):
        bsz, seqlen, _ = x.shape
        q = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        q = apply_rotary_emb(q, freqs_cos, freqs_sin)
        k = apply_rotary_emb(k, freqs_cos, freqs_sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if input_pos is not None:
            k_all, v_all = self.kv_cache.update(input_pos, k, v)
            k, v = k_all[:, :, : int(input_pos[-1]) + 1], v_all[:, :, : int(input_pos[-1]) + 1]
            mask = mask[:, : k.shape[2]]
        k = k.repeat_interleave(self.n_rep, dim=1)
        v = v.repeat_interleave(self.n_rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.dtype))
        y = y.transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        return self.wo(y)


class FeedForward(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.hidden_dim, bias=False)
        self.w2 = nn.Linear(args.hidden_dim, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id, args):
        super().__init__()
        self.attention = Attention(args, layer_id)
        self.feed_forward = FeedForward(args)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x, freqs_cos, freqs_sin, mask, input_pos):
        h = x + self.attention(self.attention_norm(x), freqs_cos, freqs_sin, mask, input_pos)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, params):
        super().__init__()
        self.params = params
        self.tok_embeddings = nn.Embedding(params.vocab_size, params.dim)
        self.layers = nn.ModuleList([TransformerBlock(i, params) for i in range(params.n_layers)])
        self.norm = RMSNorm(params.dim, params.norm_eps)
        self.output = nn.Linear(params.dim, params.vocab_size, bias=False)
        cos, sin = precompute_freqs(params.dim // params.n_heads, params.max_seq_len, params.rope_freq_base)
        self.register_buffer("freqs_cos", cos, persistent=False)  # float64 tables, cast at use
        self.register_buffer("freqs_sin", sin, persistent=False)
        causal = torch.full((params.max_seq_len, params.max_seq_len), float("-inf")).triu(1)
        self.register_buffer("mask", causal, persistent=False)
        self.current_pos = 0

    def reset_kv_cache(self):
        self.current_pos = 0
        for layer in self.layers:
            layer.attention.kv_cache.k_cache.zero_()
            layer.attention.kv_cache.v_cache.zero_()

    def forward(self, tokens, start_pos=None, use_cache=False):
        if start_pos is not None:
            use_cache = True
            if start_pos == 0:
                self.reset_kv_cache()
            self.current_pos = int(start_pos)
        seqlen = tokens.shape[1]
        h = self.tok_embeddings(tokens)
        if use_cache:
            input_pos = torch.arange(self.current_pos, self.current_pos + seqlen, device=tokens.device)
            freqs_cos, freqs_sin = self.freqs_cos[input_pos], self.freqs_sin[input_pos]
            mask = self.mask[input_pos]
            self.current_pos += seqlen
        else:
            input_pos = None
            freqs_cos, freqs_sin = self.freqs_cos[:seqlen], self.freqs_sin[:seqlen]
            mask = self.mask[:seqlen, :seqlen]
        for layer in self.layers:
            h = layer(h, freqs_cos, freqs_sin, mask, input_pos)
        return self.output(self.norm(h))


def make_model():
    torch.manual_seed(0)
    model = Transformer(ModelArgs())
    for m in model.modules():
        if isinstance(m, RMSNorm):
            nn.init.uniform_(m.weight, 0.6, 1.4)
    return model.eval()

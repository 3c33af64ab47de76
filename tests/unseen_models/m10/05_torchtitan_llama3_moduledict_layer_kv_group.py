"""torchtitan's Llama 3 (torchtitan/models/llama3/model.py), training-side model without a cache.

Transformer: tok_embeddings, layers (an nn.ModuleDict keyed "0", "1", "2", as torchtitan keeps layer ids
stable for pipeline splitting), norm, output.  TransformerBlock: attention_norm -> attention ->
+ residual, ffn_norm -> feed_forward (w1, w2, w3).  Attention: wq/wk/wv/wo without bias, GQA 4/2,
complex rotary (`precompute_freqs_cis` + `apply_rotary_emb` through view_as_complex, interleaved pairs,
theta 5e5), `repeat_kv` on the (bs, slen, heads, hd) layout, then SDPA with is_causal.  freqs_cis is a
complex128 attribute (not a buffer) cast to the activations' complex dtype at use.
Slip: blocks with `layer_id >= args.cp_start_layer` (here only "2") were built with the context-parallel
fork's `repeat_kv_cp`, which inserts the repeat axis *before* the kv-head axis
(bs, slen, n_rep, n_kv_heads, hd): query head h then reads kv head h % 2 instead of h // 2.
No cache.  Returns a logits tensor.
"""

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["layers.0.attention", "layers.1.attention", "layers.2.attention"],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "layers.2.attention",
    "stage": "scores",
    "mistake": "kv_group_mapping",
    "style": "torchtitan llama3 model.py: ModuleDict layers '0'..'2', complex freqs_cis (interleaved) theta 5e5, "
    "repeat_kv on (bs, slen, h, d), SDPA is_causal, GQA 4/2; layer '2' repeats kv heads with the repeat axis "
    "before the kv axis (head h -> kv h % 2)",
}


@dataclass
class ModelArgs:
    dim: int = 64
    n_layers: int = 3
    n_heads: int = 4
    n_kv_heads: int = 2
    vocab_size: int = 128
    hidden_dim: int = 128
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_seq_len: int = 64
    cp_start_layer: int = 2


def precompute_freqs_cis(dim, end, theta):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64)[: dim // 2] / dim))
    t = torch.arange(end, dtype=torch.float64)
    freqs = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_emb(xq, xk, freqs_cis):
    cdtype = torch.complex128 if xq.dtype == torch.float64 else torch.complex64
    xq_ = torch.view_as_complex(xq.reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.reshape(*xk.shape[:-1], -1, 2))
    fc = freqs_cis.to(device=xq.device, dtype=cdtype).view(1, xq.shape[1], 1, xq_.shape[-1])
    xq_out = torch.view_as_real(xq_ * fc).flatten(3)
    xk_out = torch.view_as_real(xk_ * fc).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(x, n_rep):
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return x[:, :, :, None, :].expand(bs, slen, n_kv_heads, n_rep, head_dim).reshape(bs, slen, n_kv_heads * n_rep, head_dim)


def repeat_kv_cp(x, n_rep):
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return x[:, :, None, :, :].expand(bs, slen, n_rep, n_kv_heads, head_dim).reshape(bs, slen, n_kv_heads * n_rep, head_dim)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, model_args, layer_id):
        super().__init__()
        self.n_heads = model_args.n_heads
        self.n_kv_heads = model_args.n_kv_heads
        self.n_rep = self.n_heads // self.n_kv_heads
        self.head_dim = model_args.dim // model_args.n_heads
        self.wq = nn.Linear(model_args.dim, model_args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(model_args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(model_args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(model_args.n_heads * self.head_dim, model_args.dim, bias=False)
        self._repeat = repeat_kv_cp if layer_id >= model_args.cp_start_layer else repeat_kv

    def forward(self, x, freqs_cis):
        bs, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bs, seqlen, -1, self.head_dim)
        xk = xk.view(bs, seqlen, -1, self.head_dim)
        xv = xv.view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
        keys = self._repeat(xk, self.n_rep)
        values = self._repeat(xv, self.n_rep)
        xq, xk, xv = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        output = F.scaled_dot_product_attention(xq, xk, xv, is_causal=True)
        output = output.transpose(1, 2).contiguous().view(bs, seqlen, -1)
        return self.wo(output)


class FeedForward(nn.Module):
    def __init__(self, dim, hidden_dim):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id, model_args):
        super().__init__()
        self.attention = Attention(model_args, layer_id)
        self.feed_forward = FeedForward(model_args.dim, model_args.hidden_dim)
        self.attention_norm = RMSNorm(model_args.dim, model_args.norm_eps)
        self.ffn_norm = RMSNorm(model_args.dim, model_args.norm_eps)

    def forward(self, x, freqs_cis):
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, model_args):
        super().__init__()
        self.model_args = model_args
        self.tok_embeddings = nn.Embedding(model_args.vocab_size, model_args.dim)
        self.freqs_cis = precompute_freqs_cis(model_args.dim // model_args.n_heads, model_args.max_seq_len * 2,
                                              model_args.rope_theta)
        self.layers = nn.ModuleDict()
        for layer_id in range(model_args.n_layers):
            self.layers[str(layer_id)] = TransformerBlock(layer_id, model_args)
        self.norm = RMSNorm(model_args.dim, model_args.norm_eps)
        self.output = nn.Linear(model_args.dim, model_args.vocab_size, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        freqs_cis = self.freqs_cis[: tokens.shape[1]]
        for layer in self.layers.values():
            h = layer(h, freqs_cis)
        return self.output(self.norm(h))


def make_model():
    torch.manual_seed(0)
    model = Transformer(ModelArgs())
    for m in model.modules():
        if isinstance(m, RMSNorm):
            nn.init.uniform_(m.weight, 0.6, 1.4)
    return model.eval()

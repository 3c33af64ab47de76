"""Byte Latent Transformer (facebookresearch/blt, bytelatent base_transformer.py): wq/wk/wv/wo
projections without bias, n_kv_heads grouped heads expanded by repeat_kv(x, n_rep, dim=2) on the
[batch, seq, heads, head_dim] layout, RoPE as a real 2x2 rotation table freqs_cis[seq, head_dim/2, 2, 2]
(stack(cos, -sin, sin, cos)) applied to interleaved pairs by apply_rotary_emb(xq, xk, seq_dim=1, ...),
torch SDPA with either mask="causal" or the boolean local sliding-window mask that the byte-level
local models build (local_attention_window_len); RMSNorm pre-norm TransformerBlock with SwiGLU w1/w3/w2.

This file: one bug: the local mask keeps q_idx - kv_idx <= window, so each query sees 9 keys instead of 8"""

import torch
from torch import nn
from torch.nn import functional as F


class LocalModelArgs:
    dim = 64
    n_heads = 4
    n_kv_heads = 2
    head_dim = 16
    rope_theta = 10000.0
    max_seqlen = 128
    norm_eps = 1e-5
    ffn_dim = 128
    attn_bias_type = "local_block_causal"
    local_attention_window_len = 8
    patch_size = 4
    diff_lambda_init = 0.8


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        output = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + self.eps)
        return output * self.weight


def precompute_freqs_cis(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64)[: (dim // 2)] / dim))
    t = torch.arange(end, dtype=torch.float64)
    freqs = torch.outer(t, freqs)
    cos, sin = freqs.cos(), freqs.sin()
    return torch.stack((cos, -sin, sin, cos), dim=-1).view(*freqs.size(), 2, 2)


def reshape_for_broadcast(freqs_cis, x, seq_dim):
    ndim = x.ndim
    shape = [
        d if i == seq_dim or i == ndim - 3 else 1 for i, d in enumerate(x.shape[:-2])
    ] + [2, 2]
    return freqs_cis.view(*shape)


def apply_rotary_emb(xq, xk, seq_dim, freqs_cis):
    xq_ = xq.reshape(*xq.shape[:-1], -1, 1, 2)  # B S H D -> B S H D/2 1 2
    xk_ = xk.reshape(*xk.shape[:-1], -1, 1, 2)
    freqs_cis = reshape_for_broadcast(freqs_cis, xq_, seq_dim).to(xq.dtype)  # S D/2 2 2 -> 1 S 1 D/2 2 2
    xq_out = (xq_ * freqs_cis).sum(5).flatten(3)
    xk_out = (xk_ * freqs_cis).sum(5).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def repeat_kv(x, n_rep, dim):
    assert dim == 2, "Only dim=2 is supported. Check the implementation for other dims."
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return (
        x[:, :, :, None, :]
        .expand(bs, slen, n_kv_heads, n_rep, head_dim)
        .reshape(bs, slen, n_kv_heads * n_rep, head_dim)
    )


class RotaryEmbedding(nn.Module):
    def __init__(self, theta, head_dim, max_seqlen=1024):
        super().__init__()
        self.theta = theta
        self.head_dim = head_dim
        self.max_seqlen = max_seqlen
        self.register_buffer(
            "freqs_cis",
            precompute_freqs_cis(dim=head_dim, end=max_seqlen, theta=theta),
            persistent=False,
        )

    def forward(self, seqlen=None, tok_idx=None):
        if tok_idx is not None:
            return self.freqs_cis[tok_idx]
        return self.freqs_cis[0:seqlen]


class Attention(nn.Module):
    def __init__(self, dim, head_dim, n_heads, n_kv_heads, rope_theta):
        super().__init__()
        self.dim = dim
        self.head_dim = head_dim
        self.rope_theta = rope_theta
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.heads_per_group = self.n_heads // self.n_kv_heads
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)

    def forward(self, x, freq_cis, tok_idx=None, mask=None):
        bsz, seq_len, dim = x.shape
        xq = self.wq(x.view_as(x))
        xk = self.wk(x.view_as(x))
        xv = self.wv(x.view_as(x))

        output_shape = xq.shape
        xq = xq.view(bsz, seq_len, self.n_heads, self.head_dim)
        xk = xk.view(bsz, seq_len, self.n_kv_heads, self.head_dim)
        xv = xv.view(bsz, seq_len, self.n_kv_heads, self.head_dim)

        xq, xk = apply_rotary_emb(xq, xk, 1, freq_cis[0:seq_len])

        xk = repeat_kv(xk, self.heads_per_group, dim=2)
        xv = repeat_kv(xv, self.heads_per_group, dim=2)

        is_causal = (mask == "causal") if isinstance(mask, str) else False
        mask = mask if isinstance(mask, torch.Tensor) else None
        xq, xk, xv = map(lambda e: e.transpose(1, 2), (xq, xk, xv))
        output = F.scaled_dot_product_attention(
            xq, xk, xv, is_causal=is_causal and seq_len > 1, attn_mask=mask
        )
        output = output.transpose(1, 2).contiguous()
        return self.wo(output.reshape(output_shape))


class FeedForward(nn.Module):
    def __init__(self, dim, hidden_dim):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.attention = Attention(
            dim=args.dim,
            head_dim=args.head_dim,
            n_heads=args.n_heads,
            n_kv_heads=args.n_kv_heads,
            rope_theta=args.rope_theta,
        )
        self.feed_forward = FeedForward(args.dim, args.ffn_dim)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x, freq_cis, tok_idx=None, mask=None):
        h = x + self.attention(self.attention_norm(x), freq_cis, tok_idx=tok_idx, mask=mask)
        return h + self.feed_forward(self.ffn_norm(h))


def create_causal_mask(seqlen, attn_bias_type, sliding_window=None, device=None):
    if attn_bias_type == "causal":
        return "causal"
    if attn_bias_type == "local_block_causal":
        q_idx = torch.arange(seqlen, device=device)[:, None]
        kv_idx = torch.arange(seqlen, device=device)[None, :]
        causal = kv_idx <= q_idx
        in_window = (q_idx - kv_idx) <= sliding_window
        return causal & in_window
    raise NotImplementedError(attn_bias_type)


class LocalEncoder(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.attn_bias_type = args.attn_bias_type
        self.sliding_window = args.local_attention_window_len
        self.rope = RotaryEmbedding(
            theta=args.rope_theta, head_dim=args.head_dim, max_seqlen=args.max_seqlen
        )
        self.layers = nn.ModuleList([TransformerBlock(args)])
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, h):
        bsz, seqlen, _ = h.shape
        mask = create_causal_mask(
            seqlen, self.attn_bias_type, sliding_window=self.sliding_window, device=h.device
        )
        tok_idx = None
        freq_cis = self.rope(seqlen=seqlen, tok_idx=tok_idx)
        for layer in self.layers:
            h = layer(h, freq_cis, tok_idx=tok_idx, mask=mask)
        return self.norm(h)


def make_blt():
    torch.manual_seed(2714)
    args = LocalModelArgs()
    model = LocalEncoder(args)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, RMSNorm):
                mod.weight.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {
    "target": "make_blt",
    "kind": "causal-multihead",
    "ok": False,
    "layer": "layers.0.attention",
    "stage": "masked_scores",
    "mistake": "window_size",
    "style": "BLT Attention: local mask q - kv <= window: 9 keys visible for a declared window of 8",
}

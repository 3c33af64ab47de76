"""OpenPPL ppl.pmx model zoo (the static-batching Transformer of model_zoo/*/modeling with the PMX
torch_function operators): an Attention module whose projection is one fused `wqkv` or separate
`wq`/`wk`/`wv` (optional bias terms), reshaped to (batch, seqlen, -1, head_dim) and split along the
head axis; keys/values stay at `num_kv_heads` and the MultiHeadAttention operator widens them with
an expand on a new axis after the head axis (or, with `friendly_gqa`, the key/value cache hands back
already repeated heads). ALiBi comes either from the operator's `is_alibi` flag (an ALiBiMask of
shape (heads, seqlen_q, seqlen_kv padded to 16) with -inf on the future keys) or from a finite
ALiBi bias the model builds once and passes as `attn_mask`; `is_causal` masks the future keys.
Pre-norm RMSNorm block with a SiLU-gated feed-forward (w1, w3, w2).

This file: one bug (base c01_pmx_gqa_alibi_op): the layer calls multi_head_attention without is_alibi=True (default False): causal mask only, no ALiBi."""

import math

import torch
import torch.nn.functional as F
from torch import nn


class ModelParams:
    hidden_dim = 64
    num_heads = 4
    num_kv_heads = 2
    head_dim = 16
    intermediate_dim = 128
    norm_eps = 1e-5
    fused_qkv = True
    linear_bias_term = True
    friendly_gqa = False
    auto_causal = True
    alibi_in_attention = True  # False: the model builds one ALiBi bias and passes it down


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        inv_rms = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * (x * inv_rms)


def alibi_slopes(num_heads, device=None):
    """Press et al.'s slopes, in float64: the geometric sequence 2^(-8n/p) for the largest power of
    two p <= num_heads, then the odd-numbered slopes of the 2p sequence for the remaining heads."""
    pow2 = 2 ** math.floor(math.log2(num_heads))
    slopes = [2.0 ** (-8.0 * n / pow2) for n in range(1, pow2 + 1)]
    if pow2 < num_heads:
        slopes += [2.0 ** (-4.0 * n / pow2) for n in range(1, 2 * (num_heads - pow2), 2)]
    return torch.tensor(slopes, dtype=torch.float64, device=device)


def alibi_mask(seqlen_q, seqlen_kv, num_heads, dtype, device=None):
    """What the ALiBiMask operator returns: (num_heads, seqlen_q, padded_kv), the kv axis padded to a
    multiple of 16; slope times the (negative) distance on the keys a query may see, -inf on the
    keys after it and on the padding. Queries are the last seqlen_q positions of the keys."""
    padded_kv = (seqlen_kv + 15) // 16 * 16
    q_pos = torch.arange(seqlen_kv - seqlen_q, seqlen_kv, dtype=torch.float64, device=device)
    k_pos = torch.arange(padded_kv, dtype=torch.float64, device=device)
    dist = q_pos[:, None] - k_pos[None, :]  # how far back each key lies; < 0 for later keys
    bias = -alibi_slopes(num_heads, device)[:, None, None] * dist
    bias = bias.masked_fill(dist < 0, float("-inf"))
    return bias.to(dtype)


def alibi_bias(seqlen, num_heads, dtype, device=None):
    """The finite ALiBi bias (no mask in it) a model builds once per forward: (1, heads, s, s)."""
    pos = torch.arange(seqlen, dtype=torch.float64, device=device)
    rel = pos[None, :] - pos[:, None]  # key position minus query position
    bias = alibi_slopes(num_heads, device)[:, None, None] * rel
    return bias.to(dtype)[None]


def _widen_heads(t, num_rep):
    """(b, s, kv_heads, d) -> (b, s, kv_heads * num_rep, d): every kv head repeated num_rep times in
    place, so query head h reads kv head h // num_rep."""
    bsz, seqlen, kv_heads, head_dim = t.shape
    t = t[:, :, :, None, :].expand(bsz, seqlen, kv_heads, num_rep, head_dim)
    return t.reshape(bsz, seqlen, kv_heads * num_rep, head_dim)


def multi_head_attention(
    query,
    key,
    value,
    attn_mask,
    num_heads,
    head_dim,
    is_causal=True,
    is_alibi=False,
    softmax_scale=0.0,
    num_kv_heads=0,
):
    """query (b, seqlen_q, heads, d); key/value (b, seqlen_kv, kv_heads, d); returns (b, seqlen_q,
    heads, d). num_kv_heads == 0 means the same as num_heads."""
    scale = softmax_scale if softmax_scale else 1.0 / math.sqrt(head_dim)
    seqlen_q, seqlen_kv = query.shape[1], key.shape[1]
    kv_heads = num_kv_heads if num_kv_heads else num_heads
    if kv_heads != num_heads:
        key = _widen_heads(key, num_heads // kv_heads)
        value = _widen_heads(value, num_heads // kv_heads)

    q = query.transpose(1, 2)
    k = key.transpose(1, 2)
    v = value.transpose(1, 2)
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    if is_alibi:
        scores = (
            scores
            + alibi_mask(seqlen_q, seqlen_kv, num_heads, scores.dtype, scores.device)[
                ..., :seqlen_kv
            ]
        )
    if attn_mask is not None and attn_mask.numel() > 0:
        scores = scores + attn_mask[..., :seqlen_kv]
    if is_causal and seqlen_q > 1:
        future = torch.ones(seqlen_q, seqlen_kv, dtype=torch.bool, device=scores.device)
        future = future.triu(seqlen_kv - seqlen_q + 1)
        scores = scores.masked_fill(future, -1e9)
    probs = F.softmax(scores, dim=-1)
    return torch.matmul(probs, v).transpose(1, 2).contiguous()


class Attention(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.num_heads = args.num_heads
        self.num_kv_heads = args.num_kv_heads
        self.num_kv_repeats = self.num_heads // self.num_kv_heads
        self.head_dim = args.head_dim
        self.friendly_gqa = args.friendly_gqa
        self.fused_qkv = args.fused_qkv
        self.auto_causal = args.auto_causal
        self.alibi_in_attention = args.alibi_in_attention
        q_dim = self.num_heads * self.head_dim
        kv_dim = self.num_kv_heads * self.head_dim
        if self.fused_qkv:
            self.wqkv = nn.Linear(args.hidden_dim, q_dim + 2 * kv_dim, bias=args.linear_bias_term)
        else:
            self.wq = nn.Linear(args.hidden_dim, q_dim, bias=args.linear_bias_term)
            self.wk = nn.Linear(args.hidden_dim, kv_dim, bias=args.linear_bias_term)
            self.wv = nn.Linear(args.hidden_dim, kv_dim, bias=args.linear_bias_term)
        self.wo = nn.Linear(q_dim, args.hidden_dim, bias=args.linear_bias_term)

    def forward(self, x, attn_mask):
        bsz, seqlen, _ = x.shape
        expanded = (bsz, seqlen, -1, self.head_dim)
        if self.fused_qkv:
            xqkv = self.wqkv(x).reshape(expanded)
            split = (self.num_heads, self.num_kv_heads, self.num_kv_heads)
            xq, xk, xv = torch.split(xqkv, split, dim=-2)
        else:
            xq = self.wq(x).reshape(expanded)
            xk = self.wk(x).reshape(expanded)
            xv = self.wv(x).reshape(expanded)
        keys, values = xk, xv
        if self.friendly_gqa:
            # the key/value cache returns the heads already repeated for the queries
            keys = keys.repeat_interleave(self.num_kv_repeats, dim=2)
            values = values.repeat_interleave(self.num_kv_repeats, dim=2)
        attn = multi_head_attention(
            xq,
            keys,
            values,
            attn_mask,
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            is_causal=self.auto_causal,
            num_kv_heads=0 if self.friendly_gqa else self.num_kv_heads,
        )
        return self.wo(attn.reshape(bsz, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.w1 = nn.Linear(args.hidden_dim, args.intermediate_dim, bias=False)
        self.w3 = nn.Linear(args.hidden_dim, args.intermediate_dim, bias=False)
        self.w2 = nn.Linear(args.intermediate_dim, args.hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args)
        self.attention_norm = RMSNorm(args.hidden_dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.hidden_dim, eps=args.norm_eps)

    def forward(self, x, attn_mask):
        h = x + self.attention(self.attention_norm(x), attn_mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, params):
        super().__init__()
        self.params = params
        self.layers = nn.ModuleList([TransformerBlock(params)])
        self.norm = RMSNorm(params.hidden_dim, eps=params.norm_eps)

    def forward(self, h):
        attn_mask = None
        if not self.params.alibi_in_attention:
            attn_mask = alibi_bias(h.shape[1], self.params.num_heads, h.dtype, h.device)
        for layer in self.layers:
            h = layer(h, attn_mask)
        return self.norm(h)


def make_pmx_model():
    torch.manual_seed(4311)
    model = Transformer(ModelParams())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, RMSNorm):
                mod.weight.uniform_(0.5, 1.5)
            elif isinstance(mod, nn.Linear) and mod.bias is not None:
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {
    "target": "make_pmx_model",
    "kind": "causal-multihead",
    "ok": False,
    "layer": "layers.0.attention",
    "stage": "biased_scores",
    "mistake": "bias_missing",
    "style": "OpenPPL ppl.pmx (b03_pmx_is_alibi_not_passed): (base c01) one bug: the layer calls "
    "multi_head_attention without is_alibi=True (default False): causal mask only, no ALiBi",
}

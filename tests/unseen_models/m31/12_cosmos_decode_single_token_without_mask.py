"""Cosmos-1.0 autoregressive world model's Transformer (NVIDIA cosmos1/models/autoregressive),
driven by token ids.

Tree: tok_embeddings, rope (RotaryPositionEmbedding "rope1d", no weights, passed to every attention
call), layers.N (TransformerBlock: attention_norm -> attention -> +, ffn_norm -> SwiGLU
feed_forward
w1/w2/w3 -> +), norm, output.  Attention: separate wq/wk/wv/wo (no bias), GQA 4 query heads over 2
kv heads, use_qk_normalization: q_norm/k_norm RMSNorm over head_dim before the rotary, halves
rotary (theta 5e5, angle
table made in float64 per call), keys repeated with repeat_interleave, then
F.scaled_dot_product_attention with scale 1/sqrt(head_dim) and a boolean mask: rows of the
model's (64, 64) causal_mask picked with input_pos.
Cache ("book-buffers"): `model.reset_kv_cache()`, `model(prompt, use_cache=True)`, then
`model(tok, use_cache=True)`.  The first cached call after a reset allocates per-layer
`cache_k`/`cache_v` slabs (batch, kv_heads, 64, head_dim) in the activations' dtype; the new keys
are
written at input_pos and the query attends over all 64 slots through `causal_mask[input_pos]`.
`model(ids)` is the full forward and ignores the slabs.  Returns logits (b, s, 96).
Decode slip: for one-token calls made after the prompt (input_pos > 0) the model passes mask=None
(`decode_mask_free`: "a single query needs no causal mask"), but the query attends over all 64 slab
slots, so it also sees the unwritten (zero) slots.  Prompt pass and full forward are exact."""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["layers.0.attention", "layers.1.attention"],
    "kind": "causal-multihead",
    "cache": "book-buffers",
    "decode": {"mistake": "cache_mask", "step": 0, "layer": "layers.0.attention"},
    "style": "Cosmos AR, 2 layers; one-token steps attend over the whole slab without a mask",
}


class RMSNorm(nn.Module):
    """Cosmos' RMSNorm: normalise in at least float32, cast back, then the gain."""

    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        wide = torch.promote_types(x.dtype, torch.float32)
        return self._norm(x.to(wide)).type_as(x) * self.weight


class RotaryPositionEmbedding(nn.Module):
    """1-D rope of the Cosmos autoregressive model ("rope1d").

    The angle table is laid out for the halves pairing (the two copies of the frequencies side by
    side, as Transformer Engine's bshd rotary kernel expects).  Angles are made in float64 for the
    positions asked for and cast to the activations' dtype.
    """

    def __init__(self, head_dim, rope_theta):
        super().__init__()
        self.head_dim = head_dim
        self.rope_theta = rope_theta

    def angle_table(self, input_pos, dtype):
        half = torch.arange(0, self.head_dim, 2, dtype=torch.float64, device=input_pos.device)
        inv_freq = 1.0 / (self.rope_theta ** (half / self.head_dim))
        angles = input_pos.to(torch.float64)[:, None] * inv_freq[None, :]
        table = torch.cat((angles, angles), dim=-1)
        return table.cos().to(dtype), table.sin().to(dtype)

    @staticmethod
    def _turn_halves(x, cos, sin):
        first, second = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-second, first), dim=-1) * sin

    @staticmethod
    def _turn_pairs(x, cos, sin):
        even, odd = x[..., 0::2], x[..., 1::2]
        partner = torch.stack((-odd, even), dim=-1).flatten(-2)
        return x * cos + partner * sin

    def forward(self, xq, xk, input_pos, seq_len, interleaved=False):
        # xq, xk: (batch, seq, heads, head_dim)
        cos, sin = self.angle_table(input_pos[:seq_len], xq.dtype)
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]
        turn = self._turn_pairs if interleaved else self._turn_halves
        return turn(xq, cos, sin), turn(xk, cos, sin)


class Attention(nn.Module):
    """Attention of cosmos1/models/autoregressive/modules/attention.py, self-attention only."""

    def __init__(self, config, layer_id):
        super().__init__()
        self.layer_id = layer_id
        self.dim = config.dim
        self.n_local_heads = config.n_heads
        self.n_local_kv_heads = config.n_kv_heads
        self.n_rep = self.n_local_heads // self.n_local_kv_heads
        self.head_dim = config.dim // config.n_heads
        self.max_seq_len = config.max_seq_len
        self.fuse_qkv = config.fuse_qkv
        q_size = self.n_local_heads * self.head_dim
        kv_size = self.n_local_kv_heads * self.head_dim
        if self.fuse_qkv:
            self.wqkv = nn.Linear(self.dim, q_size + 2 * kv_size, bias=False)
        else:
            self.wq = nn.Linear(self.dim, q_size, bias=False)
            self.wk = nn.Linear(self.dim, kv_size, bias=False)
            self.wv = nn.Linear(self.dim, kv_size, bias=False)
        self.wo = nn.Linear(q_size, self.dim, bias=False)
        self.use_qk_normalization = config.use_qk_normalization
        if self.use_qk_normalization:
            self.q_norm = RMSNorm(self.head_dim, eps=config.norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=config.norm_eps)
        self.skip_k_norm = layer_id in config.k_norm_skip_layers
        self.interleaved_rope = layer_id in config.interleaved_rope_layers
        self.cache_k = None
        self.cache_v = None

    def init_kv_cache(self, batch_size, dtype, device):
        shape = (batch_size, self.n_local_kv_heads, self.max_seq_len, self.head_dim)
        self.cache_k = torch.zeros(shape, dtype=dtype, device=device)
        self.cache_v = torch.zeros(shape, dtype=dtype, device=device)

    def forward(self, x, rope, input_pos, mask=None, use_cache=False):
        bsz, seqlen, _ = x.shape
        if self.fuse_qkv:
            q_size = self.n_local_heads * self.head_dim
            kv_size = self.n_local_kv_heads * self.head_dim
            xq, xk, xv = self.wqkv(x).split([q_size, kv_size, kv_size], dim=-1)
        else:
            xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        xk = xk.view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
        xv = xv.view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)

        if self.use_qk_normalization:
            xq = self.q_norm(xq)
            if not self.skip_k_norm:
                xk = self.k_norm(xk)

        xq, xk = rope(xq, xk, input_pos, seqlen, interleaved=self.interleaved_rope)
        xq, xk, xv = (t.transpose(1, 2) for t in (xq, xk, xv))

        if use_cache:
            self.cache_k[:bsz, :, input_pos] = xk
            self.cache_v[:bsz, :, input_pos] = xv
            keys, values = self.cache_k[:bsz], self.cache_v[:bsz]
        else:
            keys, values = xk, xv

        keys = keys.repeat_interleave(self.n_rep, dim=1)
        values = values.repeat_interleave(self.n_rep, dim=1)
        output = F.scaled_dot_product_attention(
            xq,
            keys,
            values,
            attn_mask=mask,
            dropout_p=0.0,
            is_causal=False,
            scale=1.0 / math.sqrt(self.head_dim),
        )
        output = output.transpose(1, 2).contiguous().view(bsz, seqlen, -1)
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
    def __init__(self, config, layer_id):
        super().__init__()
        self.attention = Attention(config, layer_id)
        self.feed_forward = FeedForward(config.dim, config.ffn_hidden_size)
        self.attention_norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.ffn_norm = RMSNorm(config.dim, eps=config.norm_eps)

    def forward(self, x, rope, input_pos, mask, use_cache):
        h = x + self.attention(self.attention_norm(x), rope, input_pos, mask, use_cache)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Cosmos AR Transformer driven by token ids; caches live in the attention modules."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.max_seq_len = config.max_seq_len
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.rope = RotaryPositionEmbedding(config.dim // config.n_heads, config.rope_theta)
        self.layers = nn.ModuleList(TransformerBlock(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        full = torch.tril(torch.ones(config.max_seq_len, config.max_seq_len, dtype=torch.bool))
        self.register_buffer("causal_mask", full, persistent=False)
        self.decode_mask_free = config.decode_mask_free
        self.cache_len = 0
        self.cache_batch = None

    def reset_kv_cache(self):
        self.cache_len = 0
        self.cache_batch = None
        for block in self.layers:
            block.attention.cache_k = None
            block.attention.cache_v = None

    def setup_caches(self, batch_size, dtype, device):
        for block in self.layers:
            block.attention.init_kv_cache(batch_size, dtype, device)
        self.cache_batch = batch_size

    def forward(self, tokens, use_cache=False):
        bsz, seqlen = tokens.shape
        h = self.tok_embeddings(tokens)
        if use_cache:
            if self.cache_batch is None:
                self.setup_caches(bsz, h.dtype, h.device)
            if bsz != self.cache_batch:
                raise ValueError(f"cache set up for batch {self.cache_batch}, got {bsz}")
            if self.cache_len + seqlen > self.max_seq_len:
                raise ValueError("sequence longer than max_seq_len")
            input_pos = torch.arange(self.cache_len, self.cache_len + seqlen, device=tokens.device)
            mask = self.causal_mask[None, None, input_pos]
            if seqlen == 1 and input_pos[0] > 0 and self.decode_mask_free:
                mask = None
            self.cache_len += seqlen
        else:
            input_pos = torch.arange(seqlen, device=tokens.device)
            mask = self.causal_mask[None, None, :seqlen, :seqlen]
        for block in self.layers:
            h = block(h, self.rope, input_pos, mask, use_cache)
        return self.output(self.norm(h))


def make_model():
    torch.manual_seed(3112)
    config = SimpleNamespace(
        vocab_size=96,
        dim=64,
        ffn_hidden_size=128,
        max_seq_len=64,
        norm_eps=1e-5,
        rope_theta=500000.0,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        use_qk_normalization=True,
        fuse_qkv=False,
        k_norm_skip_layers=(),
        interleaved_rope_layers=(),
        decode_mask_free=True,
    )
    model = Transformer(config)
    g = torch.Generator().manual_seed(31121)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

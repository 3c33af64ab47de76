"""apex.contrib.multihead_attn.EncdecMultiheadAttn's weight layout reused for grouped-query self-
attention with a sliding window, in a small time-major LM.

ApexWindowLM: wte, blocks.N (ApexBlock: ln_1 -> attn -> residual, ln_2 -> fc_in/fc_out silu ->
residual), ln_f, head.  EncdecStyleSelfAttn: in_proj_weight_q (E, E) and in_proj_weight_kv (kv_heads
* 2 * head_dim, E) applied with mm (no biases), kv viewed (seq, batch * kv_heads, 2, head_dim),
rotary on interleaved pairs (complex-style tables, x[2i], x[2i+1]) on queries and keys, kv heads
expanded so query head h reads kv head h // 2 (GQA 4/2), bmm * head_dim ** -0.5, window time mask
(distance < 0 or >= 6: the query sees 6 keys, itself included) filled with -inf, softmax.
Cache: hf with a rolling buffer.  `out = model(prompt, use_cache=True)`, then `model(tok,
past_key_values=out.past_key_values, use_cache=True)`; logits in `out.logits`. past_key_values is a
RollingKVCache (`seen`, `get_seq_length()`, one RollingLayerCache per block: 6 slots (6, batch *
kv_heads, 2, head_dim), slot = position % 6, the positions of each slot kept for the window mask).
The prompt attends over its own keys and leaves its last 6 in the buffer.
Correct: no slip; 3 blocks, rotary base 5e5.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": [
        "blocks.0.attn",
        "blocks.1.attn",
        "blocks.2.attn",
    ],
    "kind": "causal-multihead",
    "cache": "hf",
    "style": "apex EncdecMultiheadAttn layout for GQA 4/2: q in-proj + kv in-proj viewed "
    "(s, b*kv, 2, d), interleaved rotary, window 6 time mask; rolling 6-slot "
    "buffer as past_key_values",
}

WINDOW = 6  # keys a query may see, itself included
# Per-layer rotary application: "k" rotates the key half of the (s, b*kv, 2, d) kv tensor,
# "kv" rotates the whole kv tensor.
KV_ROTARY = {}


def rotary_cos_sin(seq_len, offset, dim, base, dtype, device):
    """Complex-style tables for interleaved pairs (x[2i], x[2i+1]); float64, cast at the end."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim))
    ang = torch.outer(
        torch.arange(offset, offset + seq_len, dtype=torch.float64, device=device), inv_freq
    )
    ang = ang.repeat_interleave(2, dim=-1)[:, None, None, :]  # (s, 1, 1, d)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def rotate_interleaved(x, cos, sin):
    x_even, x_odd = x[..., 0::2], x[..., 1::2]
    rot = torch.stack((-x_odd, x_even), dim=-1).flatten(-2)
    return x * cos + rot * sin


class EncdecStyleSelfAttn(nn.Module):
    """apex.contrib.multihead_attn.EncdecMultiheadAttn's weight layout, used for grouped
    self-attention: in_proj_weight_q (heads * d, embed) and in_proj_weight_kv
    (kv_heads * 2 * d, embed), the kv output viewed (seq, batch * kv_heads, 2, head_dim)
    (key and value interleaved per kv head)."""

    def __init__(self, embed_dim, num_heads, kv_heads, kv_rotary="k"):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.kv_heads = kv_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim**-0.5
        self.kv_rotary = kv_rotary
        self.in_proj_weight_q = nn.Parameter(torch.empty(embed_dim, embed_dim))
        self.in_proj_weight_kv = nn.Parameter(torch.empty(2 * kv_heads * self.head_dim, embed_dim))
        self.out_proj_weight = nn.Parameter(torch.empty(embed_dim, embed_dim))
        for w in (self.in_proj_weight_q, self.in_proj_weight_kv):
            nn.init.xavier_uniform_(w, gain=math.sqrt(2))
        nn.init.xavier_uniform_(self.out_proj_weight)

    def forward(self, inputs, cos, sin, layer_past=None):
        seqs, bsz, embed = inputs.shape
        heads, kvh, hd = self.num_heads, self.kv_heads, self.head_dim
        q = torch.mm(inputs.reshape(seqs * bsz, embed), self.in_proj_weight_q.t())
        q = q.view(seqs, bsz, heads, hd)
        kv = torch.mm(inputs.reshape(seqs * bsz, embed), self.in_proj_weight_kv.t())
        kv = kv.view(seqs, bsz, kvh, 2, hd)
        q = rotate_interleaved(q, cos, sin)
        if self.kv_rotary == "kv":
            kv = rotate_interleaved(kv, cos[:, :, :, None], sin[:, :, :, None])
        else:
            kv = torch.stack((rotate_interleaved(kv[:, :, :, 0], cos, sin), kv[:, :, :, 1]), dim=3)
        kv = kv.view(seqs, bsz * kvh, 2, hd)
        keys, values = kv[:, :, 0], kv[:, :, 1]
        if layer_past is not None:
            keys, values = layer_past.update(keys, values)
            key_pos = layer_past.key_positions()
        else:
            key_pos = torch.arange(seqs, device=inputs.device)
        q_pos = key_pos.new_tensor(range(seqs)) + (key_pos.max() + 1 - seqs)
        sk = keys.size(0)
        rep = heads // kvh
        # (s, b*kv, d) -> (b*heads, s, d): query head h reads kv head h // rep
        keys = (
            keys.view(sk, bsz, kvh, 1, hd)
            .expand(sk, bsz, kvh, rep, hd)
            .reshape(sk, bsz * heads, hd)
        )
        values = (
            values.view(sk, bsz, kvh, 1, hd)
            .expand(sk, bsz, kvh, rep, hd)
            .reshape(sk, bsz * heads, hd)
        )
        queries = q.reshape(seqs, bsz * heads, hd)
        scores = torch.bmm(queries.transpose(0, 1), keys.permute(1, 2, 0)) * self.scaling
        dist = q_pos[:, None] - key_pos[None, :]
        time_mask = (dist < 0) | (dist >= WINDOW)
        scores = scores.masked_fill(time_mask, float("-inf"))
        probs = F.softmax(scores, dim=-1)
        ctx = (
            torch.bmm(probs, values.transpose(0, 1))
            .transpose(0, 1)
            .contiguous()
            .view(seqs, bsz, embed)
        )
        return torch.mm(ctx.view(seqs * bsz, embed), self.out_proj_weight.t()).view(
            seqs, bsz, embed
        )


class RollingLayerCache:
    """One layer's rolling buffer: WINDOW slots (slot = position % WINDOW), time-major
    (WINDOW, batch * kv_heads, 2, head_dim)."""

    def __init__(self, owner):
        self.owner = owner
        self.buf = None
        self.slot_pos = None

    def update(self, keys, values):
        start = self.owner.seen
        seqs = keys.size(0)
        if start == 0:
            # prompt: attend over the fresh keys, then keep the last WINDOW of them
            self.buf = keys.new_zeros(WINDOW, keys.size(1), 2, keys.size(2))
            self.slot_pos = torch.full((WINDOW,), -1, dtype=torch.long, device=keys.device)
            self._positions = torch.arange(seqs, device=keys.device)
            for t in range(max(0, seqs - WINDOW), seqs):
                self.buf[t % WINDOW, :, 0] = keys[t]
                self.buf[t % WINDOW, :, 1] = values[t]
                self.slot_pos[t % WINDOW] = t
            return keys, values
        for t in range(seqs):
            pos = start + t
            self.buf[pos % WINDOW, :, 0] = keys[t]
            self.buf[pos % WINDOW, :, 1] = values[t]
            self.slot_pos[pos % WINDOW] = pos
        valid = self.slot_pos >= 0
        self._positions = self.slot_pos[valid]
        return self.buf[valid, :, 0], self.buf[valid, :, 1]

    def key_positions(self):
        return self._positions


class RollingKVCache:
    """past_key_values object (Mistral-style rolling buffer, one RollingLayerCache per layer)."""

    def __init__(self, n_layers):
        self.seen = 0
        self.layers = [RollingLayerCache(self) for _ in range(n_layers)]

    def __getitem__(self, i):
        return self.layers[i]

    def get_seq_length(self):
        return self.seen


class ApexBlock(nn.Module):
    def __init__(self, hidden, heads, kv_heads, ffn, kv_rotary):
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden)
        self.attn = EncdecStyleSelfAttn(hidden, heads, kv_heads, kv_rotary)
        self.ln_2 = nn.LayerNorm(hidden)
        self.fc_in = nn.Linear(hidden, ffn)
        self.fc_out = nn.Linear(ffn, hidden)

    def forward(self, x, cos, sin, layer_past=None):
        x = x + self.attn(self.ln_1(x), cos, sin, layer_past)
        return x + self.fc_out(F.silu(self.fc_in(self.ln_2(x))))


class ApexWindowLM(nn.Module):
    def __init__(self, vocab=96, hidden=64, heads=4, kv_heads=2, ffn=128, n_layers=3, base=10000.0):
        super().__init__()
        self.heads = heads
        self.base = base
        self.n_layers = n_layers
        self.wte = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(
            [
                ApexBlock(hidden, heads, kv_heads, ffn, KV_ROTARY.get(i, "k"))
                for i in range(n_layers)
            ]
        )
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        seqs = input_ids.shape[1]
        offset = 0
        if use_cache and past_key_values is None:
            past_key_values = RollingKVCache(self.n_layers)
        if past_key_values is not None:
            offset = past_key_values.seen
        x = self.wte(input_ids.t())
        cos, sin = rotary_cos_sin(
            seqs, offset, x.size(-1) // self.heads, self.base, x.dtype, x.device
        )
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, past_key_values[i] if past_key_values is not None else None)
        logits = self.head(self.ln_f(x)).transpose(0, 1)
        if past_key_values is not None:
            past_key_values.seen = offset + seqs
            return SimpleNamespace(logits=logits, past_key_values=past_key_values)
        return SimpleNamespace(logits=logits, past_key_values=None)


def make_model():
    torch.manual_seed(2704)
    model = ApexWindowLM(n_layers=3, base=500000.0)
    g = torch.Generator().manual_seed(2704 + 1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model.eval()

"""A small GPT on NVIDIA apex blocks: apex.contrib.multihead_attn.SelfMultiheadAttn (impl 'default',
the python SelfAttnFunc path) plus apex.transformer's fused_apply_rotary_pos_emb, hidden states
kept time-major (seq, batch, hidden) as Megatron does.

ApexGPT: word_embeddings, layers.N (TransformerLayer: input_layernorm -> self_attn -> residual,
post_attention_layernorm -> mlp dense_h_to_4h/dense_4h_to_h gelu -> residual), final_layernorm,
lm_head.  SelfMultiheadAttn: in_proj_weight (3E, E) / in_proj_bias applied with addmm, the result
viewed (seq, batch * heads, 3, head_dim) (q, k, v interleaved per head), rotary on q and k in the
sbhd layout (emb = cat(freqs, freqs), rotate_half: halves pairing), baddbmm with alpha = head_dim **
-0.5, time mask (True = masked) filled with -inf, softmax, bmm, out_proj_weight / out_proj_bias with
addmm. MHA 4/4.
Cache: book-buffers.  `model.reset_kv_cache()`, `model(prompt, use_cache=True)`, then `model(tok,
use_cache=True)`.  Each SelfMultiheadAttn keeps time-major slabs k_buf / v_buf (64, batch * heads,
head_dim), allocated at the prefill call, written at [kv_len, kv_len + s) with rotated keys; the
model's kv_len advances after the layers.  `model(ids)` touches no cache; returns the logits tensor
(batch, seq, vocab).
Slip: on decode steps (kv_len > 0) the rotary offset is taken as kv_len + seq_len (the offset after
the step), so each decoded query and key is rotated for position p + 1; the slab slot and the mask
are right.  The prompt call uses offset 0: full forward and prompt pass exact.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": [
        "layers.0.self_attn",
        "layers.1.self_attn",
        "layers.2.self_attn",
    ],
    "kind": "causal-multihead",
    "cache": "book-buffers",
    "decode": {
        "mistake": "cache_positions",
        "step": 0,
        "layer": "layers.0.self_attn",
    },
    "style": "apex GPT as 03, base 1e5; decode steps rotate the new token for position kv_len + 1",
}

# Per-layer rotary targets (apex.transformer's fused_apply_rotary_pos_emb is called per tensor).
ROTARY_TARGETS = {}


def rotary_freqs(seq_len, offset, dim, base, dtype, device):
    """Megatron/apex RotaryEmbedding: emb = cat(freqs, freqs), (s, 1, 1, d), float64 then cast."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim))
    seq = torch.arange(offset, offset + seq_len, dtype=torch.float64, device=device)
    freqs = torch.outer(seq, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb[:, None, None, :], dtype


def _rotate_half(x):
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def fused_apply_rotary_pos_emb(t, freqs):
    """apex.transformer.functional.fused_apply_rotary_pos_emb, unfused: t (s, b, h, d) sbhd."""
    emb, dtype = freqs
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    return t * cos + _rotate_half(t) * sin


class SelfMultiheadAttn(nn.Module):
    """apex.contrib.multihead_attn.SelfMultiheadAttn, impl='default' (the python SelfAttnFunc path):
    time-major input (seq, batch, embed), one in_proj whose output is viewed
    (seq, batch * heads, 3, head_dim): q, k, v interleaved per head."""

    def __init__(self, embed_dim, num_heads, rotary=("q", "k")):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim**-0.5
        self.rotary = rotary
        self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim))
        self.out_proj_weight = nn.Parameter(torch.empty(embed_dim, embed_dim))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim))
        self.out_proj_bias = nn.Parameter(torch.empty(embed_dim))
        nn.init.xavier_uniform_(self.in_proj_weight, gain=math.sqrt(2))
        nn.init.xavier_uniform_(self.out_proj_weight)
        nn.init.normal_(self.in_proj_bias, std=0.02)
        nn.init.normal_(self.out_proj_bias, std=0.02)
        self.k_buf = None
        self.v_buf = None

    def forward(self, inputs, freqs, attn_mask, start=0, use_cache=False):
        seqs, bsz, embed = inputs.shape
        heads, hd = self.num_heads, self.head_dim
        lin = torch.addmm(
            self.in_proj_bias, inputs.reshape(seqs * bsz, embed), self.in_proj_weight.t()
        )
        lin = lin.view(seqs, bsz * heads, 3, hd)
        queries = lin[:, :, 0, :].reshape(seqs, bsz, heads, hd)
        keys = lin[:, :, 1, :].reshape(seqs, bsz, heads, hd)
        values = lin[:, :, 2, :].reshape(seqs, bsz * heads, hd)
        if "q" in self.rotary:
            queries = fused_apply_rotary_pos_emb(queries, freqs)
        if "k" in self.rotary:
            keys = fused_apply_rotary_pos_emb(keys, freqs)
        queries = queries.reshape(seqs, bsz * heads, hd)
        keys = keys.reshape(seqs, bsz * heads, hd)
        if use_cache:
            # time-major slabs (max_seq, batch * heads, head_dim), written at [start, start + seqs)
            if self.k_buf is None or start == 0:
                self.k_buf = keys.new_zeros(64, bsz * heads, hd)
                self.v_buf = values.new_zeros(64, bsz * heads, hd)
            self.k_buf[start : start + seqs] = keys
            self.v_buf[start : start + seqs] = values
            keys = self.k_buf[: start + seqs]
            values = self.v_buf[: start + seqs]
        scores = torch.baddbmm(
            queries.new_zeros(bsz * heads, seqs, keys.size(0)),
            queries.transpose(0, 1),
            keys.transpose(0, 1).transpose(1, 2),
            beta=0.0,
            alpha=self.scaling,
        )
        scores = scores.masked_fill(attn_mask, float("-inf"))
        probs = F.softmax(scores, dim=-1)
        ctx = torch.bmm(probs, values.transpose(0, 1)).transpose(0, 1)
        ctx = ctx.contiguous().view(seqs, bsz, embed)
        out = torch.addmm(self.out_proj_bias, ctx.view(seqs * bsz, embed), self.out_proj_weight.t())
        return out.view(seqs, bsz, embed)


class ParallelMLP(nn.Module):
    def __init__(self, hidden, ffn):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(hidden, ffn)
        self.dense_4h_to_h = nn.Linear(ffn, hidden)

    def forward(self, x):
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x)))


class TransformerLayer(nn.Module):
    def __init__(self, hidden, heads, ffn, rotary):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(hidden)
        self.self_attn = SelfMultiheadAttn(hidden, heads, rotary)
        self.post_attention_layernorm = nn.LayerNorm(hidden)
        self.mlp = ParallelMLP(hidden, ffn)

    def forward(self, x, freqs, attn_mask, start=0, use_cache=False):
        x = x + self.self_attn(self.input_layernorm(x), freqs, attn_mask, start, use_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class ApexGPT(nn.Module):
    """Small GPT on apex blocks, hidden states kept (seq, batch, hidden) as Megatron does."""

    def __init__(self, vocab=96, hidden=64, heads=4, ffn=128, n_layers=3, rotary_base=10000.0):
        super().__init__()
        self.heads = heads
        self.rotary_base = rotary_base
        self.word_embeddings = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(
            [
                TransformerLayer(hidden, heads, ffn, ROTARY_TARGETS.get(i, ("q", "k")))
                for i in range(n_layers)
            ]
        )
        self.final_layernorm = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.kv_len = 0

    def reset_kv_cache(self):
        self.kv_len = 0
        for layer in self.layers:
            layer.self_attn.k_buf = None
            layer.self_attn.v_buf = None

    def forward(self, input_ids, use_cache=False):
        seqs = input_ids.shape[1]
        x = self.word_embeddings(input_ids.t())  # (seq, batch, hidden)
        start = 0
        pos_offset = 0
        if use_cache:
            start = self.kv_len
            # decode steps read the offset after it was advanced for the step
            pos_offset = start + seqs if start > 0 else start
        freqs = rotary_freqs(
            seqs, pos_offset, x.size(-1) // self.heads, self.rotary_base, x.dtype, x.device
        )
        # apex time mask: (seq_q, seq_k) bool, True = masked
        q_pos = torch.arange(start, start + seqs, device=x.device)[:, None]
        k_pos = torch.arange(0, start + seqs, device=x.device)[None, :]
        attn_mask = k_pos > q_pos
        for layer in self.layers:
            x = layer(x, freqs, attn_mask, start, use_cache)
        if use_cache:
            self.kv_len = start + seqs
        return self.lm_head(self.final_layernorm(x)).transpose(0, 1)


def make_model():
    torch.manual_seed(2710)
    model = ApexGPT(n_layers=3, rotary_base=100000.0)
    g = torch.Generator().manual_seed(2710 + 1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model.eval()

"""flash-linear-attention's softmax baseline (fla/models/transformer + fla/layers/attn.py) in plain torch.

TransformerForCausalLM: model (TransformerModel: embeddings, layers.N = TransformerBlock with attn_norm,
attn, mlp_norm, mlp (fla GatedMLP: gate_proj/up_proj/down_proj, swish)), norm) and lm_head.
fla `Attention`: q_proj/k_proj/v_proj/o_proj without bias, GQA 4/2, `qk_norm=True` (per-head RMSNorm
`q_norm`/`k_norm` before the rotary), fla `RotaryEmbedding` (interleaved=False: rotate-half, base 1e4)
called with `seqlen_offset`, tensors kept (b, t, h, d) as flash-attn wants them.  flash_attn is not
importable here, so `attn` falls back to `F.scaled_dot_product_attention(..., is_causal=True)` on
(b, h, t, d) with the kv heads repeat_interleave'd.
Cache: hf: `out = model(ids, use_cache=True)`, `model(tok, past_key_values=out.past_key_values,
use_cache=True)`; fla's `Cache` object (per layer `attn_state` (k, v) in (b, t, kv, d), grown on dim 1).
Slip (decode only): flash_attn_func's `causal=True` aligns the mask to the bottom-right corner; SDPA's
`is_causal=True` aligns it to the top-left.  Equal when q_len == k_len (full forward, prompt pass), but a
one-token decoding step then sees only the first cached key.
"""

from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["model.layers.0.attn", "model.layers.1.attn", "model.layers.2.attn"],
    "kind": "causal-multihead",
    "cache": "hf",
    "decode": {"mistake": "cache_mask", "step": 0, "layer": "model.layers.0.attn"},
    "style": "fla-org flash-linear-attention Transformer baseline: (b, t, h, d) tensors, per-head q_norm/k_norm "
    "before rotary with seqlen_offset, GQA 4/2, fla Cache attn_state; SDPA is_causal fallback for "
    "flash_attn_func(causal=True) is top-left aligned on decode steps",
}


class Cache:
    def __init__(self):
        self.states = []
        self._seen_tokens = 0

    def get_seq_length(self, layer_idx=0):
        return self.states[layer_idx]["attn_state"][0].shape[1] if len(self.states) > layer_idx else 0

    def update(self, attn_state, layer_idx):
        k, v = attn_state
        if len(self.states) <= layer_idx:
            self.states.append({"attn_state": (k, v)})
        else:
            pk, pv = self.states[layer_idx]["attn_state"]
            self.states[layer_idx]["attn_state"] = (torch.cat([pk, k], 1), torch.cat([pv, v], 1))
        return self.states[layer_idx]


class RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, base=10000.0, interleaved=False):
        super().__init__()
        self.dim, self.base, self.interleaved = dim, base, interleaved

    def forward(self, q, k, seqlen_offset=0):
        t = q.shape[1]
        inv = 1.0 / self.base ** (torch.arange(0, self.dim, 2, dtype=torch.float64) / self.dim)
        f = torch.outer(torch.arange(seqlen_offset, seqlen_offset + t, dtype=torch.float64), inv)
        cos = f.cos().to(q.dtype)[None, :, None]
        sin = f.sin().to(q.dtype)[None, :, None]

        def apply(x):
            x1, x2 = x[..., : self.dim // 2], x[..., self.dim // 2:]
            return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)

        return apply(q), apply(k)


class Attention(nn.Module):
    def __init__(self, hidden_size, num_heads, num_kv_heads, qk_norm, rope_theta, layer_idx):
        super().__init__()
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.num_kv_groups = num_heads // num_kv_heads
        self.head_dim = hidden_size // num_heads
        self.layer_idx = layer_idx
        self.qk_norm = qk_norm
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim)
            self.k_norm = RMSNorm(self.head_dim)
        self.rotary = RotaryEmbedding(self.head_dim, base=rope_theta)

    def forward(self, hidden_states, past_key_values=None):
        b, t, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, t, -1, self.head_dim)
        k = self.k_proj(hidden_states).view(b, t, -1, self.head_dim)
        v = self.v_proj(hidden_states).view(b, t, -1, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        seqlen_offset = past_key_values.get_seq_length(self.layer_idx) if past_key_values is not None else 0
        q, k = self.rotary(q, k, seqlen_offset=seqlen_offset)
        if past_key_values is not None:
            k, v = past_key_values.update(attn_state=(k, v), layer_idx=self.layer_idx)["attn_state"]
        # flash_attn_func(q, k, v, causal=True) is unavailable: torch fallback
        qh = q.transpose(1, 2)
        kh = k.transpose(1, 2).repeat_interleave(self.num_kv_groups, dim=1)
        vh = v.transpose(1, 2).repeat_interleave(self.num_kv_groups, dim=1)
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
        o = o.transpose(1, 2).reshape(b, t, -1)
        return self.o_proj(o), None, past_key_values


class GatedMLP(nn.Module):
    def __init__(self, hidden_size, intermediate_size):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TransformerBlock(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size)
        self.attn = Attention(config.hidden_size, config.num_heads, config.num_kv_heads, config.qk_norm,
                              config.rope_theta, layer_idx)
        self.mlp_norm = RMSNorm(config.hidden_size)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)

    def forward(self, hidden_states, past_key_values=None):
        h, _, _ = self.attn(self.attn_norm(hidden_states), past_key_values=past_key_values)
        hidden_states = hidden_states + h
        return hidden_states + self.mlp(self.mlp_norm(hidden_states))


class TransformerModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([TransformerBlock(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size)

    def forward(self, input_ids, past_key_values=None):
        h = self.embeddings(input_ids)
        for layer in self.layers:
            h = layer(h, past_key_values=past_key_values)
        return self.norm(h)


class TransformerForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = TransformerModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        if use_cache and past_key_values is None:
            past_key_values = Cache()
        h = self.model(input_ids, past_key_values=past_key_values if use_cache else None)
        return SimpleNamespace(logits=self.lm_head(h), past_key_values=past_key_values if use_cache else None)


def make_model():
    torch.manual_seed(1212)
    config = SimpleNamespace(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_heads=4,
                             num_kv_heads=2, qk_norm=True, rope_theta=10000.0)
    model = TransformerForCausalLM(config)
    g = torch.Generator().manual_seed(12121)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

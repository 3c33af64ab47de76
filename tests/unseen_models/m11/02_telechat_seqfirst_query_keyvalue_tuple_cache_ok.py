"""TeleChat (Tele-AI remote code modeling_telechat.py), reduced.

TelechatForCausalLM: transformer (TelechatModel: word_embeddings, h.N, ln_f) and lm_head.  The blocks
are BLOOM-named (input_layernorm -> self_attention -> + residual, post_attention_layernorm -> mlp with
gate_proj/up_proj/down_proj), norms are RMSNorm.  TelechatAttention works sequence-first: hidden states
are transposed to [s, b, h] before the projections; a separate `query` Linear and a fused `key_value`
Linear viewed as [s, b, heads, 2 * head_dim] and split; rotary (rotate_half, base 1e4) from a cached
cos/sin table indexed by the absolute offset; baddbmm on [b * heads, s, d] with alpha = 1/sqrt(d); a
boolean causal mask filled with -10000 before the softmax; `dense` (with bias) on the merged heads.
Cache: hf tuples: layer_past = (key, value) each [s, b, heads, d], concatenated on dim 0;
`out = model(ids, use_cache=True)`, `model(tok, past_key_values=out.past_key_values, use_cache=True)`.
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
    "layers": ["transformer.h.0.self_attention", "transformer.h.1.self_attention", "transformer.h.2.self_attention"],
    "kind": "causal-multihead",
    "cache": "hf",
    "style": "TeleChat modeling_telechat.py: sequence-first [s, b, h], `query` + fused `key_value` Linear, "
    "rotate_half rope from a cos/sin cache by offset, baddbmm alpha, -10000 boolean-mask fill, tuple cache cat on dim 0",
}


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, max_seq_len=128, base=10000.0):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        t = torch.arange(max_seq_len, dtype=torch.float64)
        freqs = torch.einsum("i,j->ij", t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos()[:, None, None, :], persistent=False)  # [s, 1, 1, d]
        self.register_buffer("sin_cached", emb.sin()[:, None, None, :], persistent=False)

    def forward(self, offset, seq_len, dtype):
        return self.cos_cached[offset:offset + seq_len].to(dtype), self.sin_cached[offset:offset + seq_len].to(dtype)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=x1.ndim - 1)


def apply_rotary_pos_emb(q, k, cos, sin):
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class TelechatAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads = config.n_head
        self.head_dim = self.hidden_size // self.num_heads
        self.norm_factor = math.sqrt(self.head_dim)
        self.query = nn.Linear(self.hidden_size, self.hidden_size, bias=False)
        self.key_value = nn.Linear(self.hidden_size, 2 * self.hidden_size, bias=False)
        self.dense = nn.Linear(self.hidden_size, self.hidden_size)
        self.rotary_emb = RotaryEmbedding(self.head_dim)
        self.layer_idx = layer_idx

    def forward(self, hidden_states, attention_mask, layer_past=None, use_cache=False):
        hidden_states = hidden_states.transpose(1, 0)  # [s, b, h]
        q_len, bsz = hidden_states.shape[:2]
        query_layer = self.query(hidden_states).view(q_len, bsz, self.num_heads, self.head_dim)
        mixed_kv = self.key_value(hidden_states).view(q_len, bsz, self.num_heads, 2 * self.head_dim)
        key_layer, value_layer = torch.split(mixed_kv, self.head_dim, dim=-1)

        offset = 0 if layer_past is None else layer_past[0].shape[0]
        cos, sin = self.rotary_emb(offset, q_len, query_layer.dtype)
        query_layer, key_layer = apply_rotary_pos_emb(query_layer, key_layer, cos, sin)
        if layer_past is not None:
            key_layer = torch.cat((layer_past[0], key_layer), dim=0)
            value_layer = torch.cat((layer_past[1], value_layer), dim=0)
        present = (key_layer, value_layer) if use_cache else None
        kv_len = key_layer.shape[0]

        q = query_layer.reshape(q_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        k = key_layer.reshape(kv_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        v = value_layer.reshape(kv_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        matmul_result = torch.empty(bsz * self.num_heads, q_len, kv_len, dtype=q.dtype, device=q.device)
        matmul_result = torch.baddbmm(matmul_result, q, k.transpose(1, 2), beta=0.0, alpha=1.0 / self.norm_factor)
        attention_scores = matmul_result.view(bsz, self.num_heads, q_len, kv_len)
        attention_scores = attention_scores.masked_fill(attention_mask, -10000.0)
        soft_dtype = torch.promote_types(attention_scores.dtype, torch.float32)
        attention_probs = F.softmax(attention_scores.to(soft_dtype), dim=-1).to(q.dtype)
        attention_probs = attention_probs.view(bsz * self.num_heads, q_len, kv_len)
        context_layer = torch.bmm(attention_probs, v)  # [b*h, s, d]
        context_layer = context_layer.view(bsz, self.num_heads, q_len, self.head_dim).permute(0, 2, 1, 3)
        context_layer = context_layer.reshape(bsz, q_len, self.hidden_size)
        return self.dense(context_layer), present


class TelechatMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.ffn_hidden_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.ffn_hidden_size, bias=False)
        self.down_proj = nn.Linear(config.ffn_hidden_size, config.hidden_size, bias=True)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TelechatBlock(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size)
        self.self_attention = TelechatAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size)
        self.mlp = TelechatMLP(config)

    def forward(self, hidden_states, attention_mask, layer_past=None, use_cache=False):
        attn_out, present = self.self_attention(self.input_layernorm(hidden_states), attention_mask, layer_past, use_cache)
        hidden_states = hidden_states + attn_out
        hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states, present


class TelechatModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.h = nn.ModuleList([TelechatBlock(config, i) for i in range(config.n_layer)])
        self.ln_f = RMSNorm(config.hidden_size)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        bsz, q_len = input_ids.shape
        past_len = 0 if past_key_values is None else past_key_values[0][0].shape[0]
        kv_len = past_len + q_len
        q_pos = torch.arange(past_len, kv_len, device=input_ids.device)
        k_pos = torch.arange(kv_len, device=input_ids.device)
        causal_mask = (k_pos[None, :] > q_pos[:, None])[None, None]  # True = hidden
        hidden_states = self.word_embeddings(input_ids)
        presents = () if use_cache else None
        for i, block in enumerate(self.h):
            layer_past = None if past_key_values is None else past_key_values[i]
            hidden_states, present = block(hidden_states, causal_mask, layer_past, use_cache)
            if use_cache:
                presents = presents + (present,)
        return self.ln_f(hidden_states), presents


class TelechatForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.transformer = TelechatModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        hidden, presents = self.transformer(input_ids, past_key_values, use_cache)
        return SimpleNamespace(logits=self.lm_head(hidden), past_key_values=presents)


def make_model():
    torch.manual_seed(1102)
    config = SimpleNamespace(vocab_size=96, hidden_size=64, n_head=4, n_layer=3, ffn_hidden_size=160)
    model = TelechatForCausalLM(config)
    g = torch.Generator().manual_seed(11021)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

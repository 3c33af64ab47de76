"""alibaba/MNN transformers/llm/export/llmexport.py: the export-side torch wrapper that MNN-LLM traces to
ONNX/MNN, kept runnable as a torch model (Qwen2-style weights).

Llm: embed (token embedding), blocks.N (Decoder: input_layernorm, self_attn, post_attention_layernorm,
mlp), final_layernorm_, lm_.  The wrapper's Attention holds q_proj/k_proj/v_proj (bias) and o_proj
(no bias) of the source model, GQA 4/2 (keys/values repeated with repeat_interleave on the head axis
of the (b, s, kv, d) layout), and a `rotary` module (rotate-half, base 1e6) fed by explicit
`position_ids`.  The whole cache is one tensor `past_key_values` of shape
(layers, 2, b, kv_len, kv_heads, head_dim); each block returns its present (2, b, kv_len, kv, d) and
the model stacks them into `presents`.  The mask comes from `get_attention_mask()` as an additive
float mask (finfo.min) of shape (1, 1, q_len, kv_len), as the MNN runtime feeds it.
Cache: hf: `out = model(prompt, use_cache=True)`, then
`model(tok, past_key_values=out.past_key_values, use_cache=True)` (the stacked tensor); logits in
`out.logits`; `model(ids)` is the full forward.
Slip: for a one-token step `get_attention_mask()` builds `(1 - tril(ones(1, 1, 1, kv_len))) * min`,
a tril whose single row is aligned top-left, so the new token keeps only key 0 (the first prompt
token) and cannot see the rest of the cache nor itself.  Positions and presents are right.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["blocks.0.self_attn", "blocks.1.self_attn", "blocks.2.self_attn"],
    "kind": "causal-multihead",
    "cache": "hf",
    "decode": {"mistake": "cache_mask", "step": 0, "layer": "blocks.0.self_attn"},
    "style": "MNN llmexport wrapper: blocks.N.self_attn with rotary module from position_ids, (b, s, kv, d) layout, one "
    "stacked past_key_values tensor (layers, 2, b, s, kv, d), finfo.min mask from get_attention_mask; decode mask row from tril top-left",
}


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x):
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.variance_epsilon))


class Rotary(nn.Module):
    def __init__(self, head_dim, base=1e6):
        super().__init__()
        self.theta = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))

    def forward(self, position_ids, dtype):
        ang = position_ids.to(torch.float64)[..., None] * self.theta
        ang = torch.cat([ang, ang], dim=-1)
        return torch.stack([ang.cos(), ang.sin()]).to(dtype)  # (2, b, s, d)

    @staticmethod
    def apply_rotary_pos(x, cos, sin):
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_key_value_heads = cfg.num_key_value_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_key_value_heads * self.head_dim, bias=True)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_key_value_heads * self.head_dim, bias=True)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask, rotary_pos_emb, past_key_value=None):
        bsz, q_len, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim)
        k = self.k_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim)
        v = self.v_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim)
        cos, sin = rotary_pos_emb[0][:, :, None], rotary_pos_emb[1][:, :, None]
        q = Rotary.apply_rotary_pos(q, cos, sin)
        k = Rotary.apply_rotary_pos(k, cos, sin)
        if past_key_value is not None:
            k = torch.cat((past_key_value[0], k), dim=1)
            v = torch.cat((past_key_value[1], v), dim=1)
        present = torch.stack((k, v))
        n_rep = self.num_heads // self.num_key_value_heads
        k = torch.repeat_interleave(k, n_rep, dim=2)
        v = torch.repeat_interleave(v, n_rep, dim=2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        attn_weights = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.head_dim)
        attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, v).transpose(1, 2).reshape(bsz, q_len, -1)
        return self.o_proj(attn_output), present


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Decoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, hidden_states, rotary_pos_emb, attention_mask, past_key_value):
        residual = hidden_states
        hidden_states, present = self.self_attn(
            self.input_layernorm(hidden_states), attention_mask, rotary_pos_emb, past_key_value
        )
        hidden_states = residual + hidden_states
        hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states, present


class Llm(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.blocks = nn.ModuleList([Decoder(cfg) for _ in range(cfg.num_hidden_layers)])
        self.final_layernorm_ = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_ = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg.hidden_size // cfg.num_attention_heads, cfg.rope_theta)

    def get_attention_mask(self, q_len, kv_len, dtype):
        if q_len == 1:
            return (1 - torch.tril(torch.ones([1, 1, 1, kv_len], dtype=dtype))) * torch.finfo(dtype).min
        past = kv_len - q_len
        causal = torch.tril(torch.ones([q_len, kv_len], dtype=dtype), diagonal=past)
        return ((1 - causal) * torch.finfo(dtype).min)[None, None]

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        bsz, q_len = input_ids.shape
        past_len = 0 if past_key_values is None else past_key_values.shape[3]
        hidden_states = self.embed(input_ids)
        position_ids = torch.arange(past_len, past_len + q_len)[None].expand(bsz, -1)
        rotary_pos_emb = self.rotary(position_ids, hidden_states.dtype)
        attention_mask = self.get_attention_mask(q_len, past_len + q_len, hidden_states.dtype)
        presents = []
        for i, block in enumerate(self.blocks):
            past = past_key_values[i] if past_key_values is not None else None
            hidden_states, present = block(hidden_states, rotary_pos_emb, attention_mask, past)
            presents.append(present)
        logits = self.lm_(self.final_layernorm_(hidden_states))
        return SimpleNamespace(logits=logits, past_key_values=torch.stack(presents) if use_cache else None)


def make_model():
    torch.manual_seed(2112)
    cfg = SimpleNamespace(
        vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1e6,
    )
    model = Llm(cfg)
    g = torch.Generator().manual_seed(21121)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

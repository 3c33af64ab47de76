"""GLM-4.5 (transformers' modeling_glm4_moe.py), small config with random weights.

Glm4MoeForCausalLM: model (embed_tokens, layers.N, norm, rotary_emb) and lm_head.  Glm4MoeDecoderLayer
is pre-norm (input_layernorm, post_attention_layernorm); layer 0 has a dense SwiGLU `mlp`
(`first_k_dense_replace` 1), layers 1-2 a sigmoid-routed top-2 MoE (4 experts, normalised top-k
weights, `routed_scaling_factor`) plus `shared_experts`.  Glm4MoeAttention: q/k/v with bias
(`attention_bias`), o without, GQA 4/2 via repeat_kv, `partial_rotary_factor` 0.5: rotate_half on the
first 8 of 16 head dims (base 5e5, from inv_freq), the rest passed through; eager matmul * scaling +
finfo.min mask; `use_qk_norm` False.
Cache: hf: `out = model(ids, use_cache=True)`, `model(tok, past_key_values=out.past_key_values,
use_cache=True)`; the cache is a `Glm4MoeCache` object (per layer (b, kv, s, d), cat on dim 2).
Correct.
"""

from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": ["model.layers.0.self_attn", "model.layers.1.self_attn", "model.layers.2.self_attn"],
    "kind": "causal-multihead",
    "cache": "hf",
    "style": "modeling_glm4_moe.py (GLM-4.5): q/k/v bias, GQA 4/2 repeat_kv, partial rotary 0.5 (rotate_half "
    "on 8 of 16 dims) base 5e5, sigmoid-routed MoE + shared experts after a dense layer 0, Glm4MoeCache object",
}


class Glm4MoeCache:
    def __init__(self):
        self.keys, self.values = [], []

    def get_seq_length(self):
        return self.keys[0].shape[2] if self.keys else 0

    def update(self, k, v, idx):
        if len(self.keys) <= idx:
            self.keys.append(k)
            self.values.append(v)
        else:
            self.keys[idx] = torch.cat([self.keys[idx], k], dim=2)
            self.values[idx] = torch.cat([self.values[idx], v], dim=2)
        return self.keys[idx], self.values[idx]


class Glm4MoeRMSNorm(nn.Module):
    def __init__(self, n, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.variance_epsilon = eps

    def forward(self, x):
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.variance_epsilon))


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def repeat_kv(x, n_rep):
    b, kv, s, d = x.shape
    if n_rep == 1:
        return x
    return x[:, :, None].expand(b, kv, n_rep, s, d).reshape(b, kv * n_rep, s, d)


class Glm4MoeRotaryEmbedding(nn.Module):
    def __init__(self, dim, base):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim), persistent=False)

    def forward(self, x, position_ids):
        freqs = position_ids[:, :, None].to(x.dtype) * self.inv_freq.to(x.dtype)[None, None]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


class Glm4MoeAttention(nn.Module):
    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.num_heads = cfg.num_attention_heads
        self.num_key_value_heads = cfg.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.scaling = self.head_dim ** -0.5
        self.rotary_dim = int(self.head_dim * cfg.partial_rotary_factor)
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_key_value_heads * self.head_dim, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_key_value_heads * self.head_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, hidden_states, position_embeddings, attention_mask=None, past_key_value=None):
        b, q_len, _ = hidden_states.shape
        shp = (b, q_len, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shp).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shp).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shp).transpose(1, 2)
        cos, sin = position_embeddings
        cos, sin = cos[:, None], sin[:, None]
        r = self.rotary_dim
        q_rot, q_pass = q[..., :r], q[..., r:]
        k_rot, k_pass = k[..., :r], k[..., r:]
        q = torch.cat([q_rot * cos + rotate_half(q_rot) * sin, q_pass], dim=-1)
        k = torch.cat([k_rot * cos + rotate_half(k_rot) * sin, k_pass], dim=-1)
        if past_key_value is not None:
            k, v = past_key_value.update(k, v, self.layer_idx)
        k = repeat_kv(k, self.num_key_value_groups)
        v = repeat_kv(v, self.num_key_value_groups)
        w = torch.matmul(q, k.transpose(2, 3)) * self.scaling
        if attention_mask is not None:
            w = w + attention_mask
        w = torch.softmax(w, dim=-1)
        o = torch.matmul(w, v).transpose(1, 2).reshape(b, q_len, -1)
        return self.o_proj(o), w


class Glm4MoeMLP(nn.Module):
    def __init__(self, hidden_size, intermediate_size):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Glm4MoeMoE(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.routed_scaling_factor = cfg.routed_scaling_factor
        self.gate = nn.Linear(cfg.hidden_size, cfg.n_routed_experts, bias=False)
        self.experts = nn.ModuleList([Glm4MoeMLP(cfg.hidden_size, cfg.moe_intermediate_size)
                                      for _ in range(cfg.n_routed_experts)])
        self.shared_experts = Glm4MoeMLP(cfg.hidden_size, cfg.moe_intermediate_size)

    def forward(self, x):
        scores = torch.sigmoid(self.gate(x))
        w, idx = scores.topk(self.top_k, dim=-1)
        w = w / w.sum(-1, keepdim=True) * self.routed_scaling_factor
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out = out + ((idx == e).to(x.dtype) * w).sum(-1, keepdim=True) * expert(x)
        return out + self.shared_experts(x)


class Glm4MoeDecoderLayer(nn.Module):
    def __init__(self, cfg, idx):
        super().__init__()
        self.self_attn = Glm4MoeAttention(cfg, idx)
        self.mlp = Glm4MoeMLP(cfg.hidden_size, cfg.intermediate_size) if idx < cfg.first_k_dense_replace else Glm4MoeMoE(cfg)
        self.input_layernorm = Glm4MoeRMSNorm(cfg.hidden_size)
        self.post_attention_layernorm = Glm4MoeRMSNorm(cfg.hidden_size)

    def forward(self, h, position_embeddings, attention_mask, past_key_value):
        a, _ = self.self_attn(hidden_states=self.input_layernorm(h), position_embeddings=position_embeddings,
                              attention_mask=attention_mask, past_key_value=past_key_value)
        h = h + a
        return h + self.mlp(self.post_attention_layernorm(h))


class Glm4MoeModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([Glm4MoeDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)])
        self.norm = Glm4MoeRMSNorm(cfg.hidden_size)
        self.rotary_emb = Glm4MoeRotaryEmbedding(
            int(cfg.hidden_size // cfg.num_attention_heads * cfg.partial_rotary_factor), cfg.rope_theta)

    def forward(self, input_ids, past_key_values=None):
        h = self.embed_tokens(input_ids)
        b, n = input_ids.shape
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        cache_position = torch.arange(past, past + n, device=input_ids.device)
        position_ids = cache_position[None].expand(b, -1)
        keypos = torch.arange(past + n, device=input_ids.device)
        mask = torch.zeros(n, past + n, dtype=h.dtype)
        mask = mask.masked_fill(keypos[None, :] > cache_position[:, None], torch.finfo(h.dtype).min)
        mask = mask[None, None]
        pe = self.rotary_emb(h, position_ids)
        for layer in self.layers:
            h = layer(h, pe, mask, past_key_values)
        return self.norm(h)


class Glm4MoeForCausalLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.model = Glm4MoeModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        if use_cache and past_key_values is None:
            past_key_values = Glm4MoeCache()
        h = self.model(input_ids, past_key_values=past_key_values)
        return SimpleNamespace(logits=self.lm_head(h), past_key_values=past_key_values if use_cache else None)


def make_model():
    torch.manual_seed(1201)
    cfg = SimpleNamespace(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0,
                          partial_rotary_factor=0.5, attention_bias=True, first_k_dense_replace=1,
                          n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                          routed_scaling_factor=1.5)
    model = Glm4MoeForCausalLM(cfg)
    g = torch.Generator().manual_seed(12011)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, Glm4MoeRMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
            if isinstance(m, nn.Linear) and m.bias is not None:
                m.bias.normal_(0.0, 0.2, generator=g)
    return model.eval()

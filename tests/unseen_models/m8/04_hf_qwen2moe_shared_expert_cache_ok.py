"""Qwen2-MoE causal LM, after transformers' modeling_qwen2_moe.py.

Qwen2MoeForCausalLM: model.embed_tokens, model.layers.N (Qwen2MoeDecoderLayer: input_layernorm,
self_attn, post_attention_layernorm, mlp), model.norm, lm_head.  Qwen2MoeAttention: q_proj/k_proj/
v_proj with bias, o_proj without, GQA 4/2 (repeat_kv), rotate_half rotary base 1e6 from a
Qwen2MoeRotaryEmbedding (inv_freq float32, cos/sin per position_ids), eager matmul * scaling,
additive causal mask with finfo.min sliced to the keys held.  The mlp of layer 0 is a dense
Qwen2MoeMLP (mlp_only_layers=[0]); layers 1-2 are Qwen2MoeSparseMoeBlock: router `gate`, 4 experts
top-2 (norm_topk_prob False), plus the `shared_expert` gated by sigmoid(shared_expert_gate(x)).
Cache: hf.  `out = model(ids, use_cache=True)` creates a Qwen2MoeCache (the Cache-like class in
this file: per-layer key/value lists, update(k, v, layer_idx), get_seq_length()), then
`model(tok, past_key_values=out.past_key_values, use_cache=True)`.
"""

from types import SimpleNamespace
from typing import List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": ["model.layers.0.self_attn", "model.layers.1.self_attn", "model.layers.2.self_attn"],
    "kind": "causal-multihead",
    "cache": "hf",
    "structure": {
        "heads": 4,
        "kv_heads": 2,
        "head_dim": 16,
        "causal": True,
        "cross": False,
        "rope": {"pairing": "half", "fraction": 1.0, "base": 1000000.0},
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "modeling_qwen2_moe.py: q/k/v bias, GQA 4/2 repeat_kv, rotate_half base 1e6, sparse MoE (4 experts top-2) "
    "with sigmoid-gated shared_expert, dense layer 0 (mlp_only_layers), Qwen2MoeCache class (update/get_seq_length)",
}


class Qwen2MoeCache:
    def __init__(self):
        self.key_cache: List[torch.Tensor] = []
        self.value_cache: List[torch.Tensor] = []

    def update(self, key_states, value_states, layer_idx):
        if len(self.key_cache) <= layer_idx:
            self.key_cache.append(key_states)
            self.value_cache.append(value_states)
        else:
            self.key_cache[layer_idx] = torch.cat([self.key_cache[layer_idx], key_states], dim=-2)
            self.value_cache[layer_idx] = torch.cat(
                [self.value_cache[layer_idx], value_states], dim=-2
            )
        return self.key_cache[layer_idx], self.value_cache[layer_idx]

    def get_seq_length(self, layer_idx=0):
        if len(self.key_cache) <= layer_idx:
            return 0
        return self.key_cache[layer_idx].shape[-2]


class Qwen2MoeRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class Qwen2MoeRotaryEmbedding(nn.Module):
    def __init__(self, dim, base):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x, position_ids):
        inv = self.inv_freq[None, :, None].to(
            x.dtype if x.dtype == torch.float64 else torch.float32
        )
        freqs = (inv @ position_ids[:, None, :].to(inv.dtype)).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(
        batch, num_key_value_heads, n_rep, slen, head_dim
    )
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class Qwen2MoeAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(
            config.hidden_size, self.num_key_value_heads * self.head_dim, bias=True
        )
        self.v_proj = nn.Linear(
            config.hidden_size, self.num_key_value_heads * self.head_dim, bias=True
        )
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states, position_embeddings, attention_mask=None, past_key_value=None):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        if past_key_value is not None:
            key_states, value_states = past_key_value.update(
                key_states, value_states, self.layer_idx
            )
        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.scaling
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask[:, :, :, : key_states.shape[-2]]
        attn_weights = (
            F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
            if query_states.dtype != torch.float64
            else F.softmax(attn_weights, dim=-1)
        )
        attn_output = torch.matmul(attn_weights, value_states).transpose(1, 2).contiguous()
        attn_output = attn_output.reshape(*input_shape, -1)
        return self.o_proj(attn_output), attn_weights


class Qwen2MoeMLP(nn.Module):
    def __init__(self, config, intermediate_size):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen2MoeSparseMoeBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList(
            [Qwen2MoeMLP(config, config.moe_intermediate_size) for _ in range(self.num_experts)]
        )
        self.shared_expert = Qwen2MoeMLP(config, config.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, hidden_states):
        b, s, d = hidden_states.shape
        hidden_states = hidden_states.view(-1, d)
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=1)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        final = torch.zeros_like(hidden_states)
        expert_mask = F.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        for e in range(self.num_experts):
            idx, top_x = torch.where(expert_mask[e])
            if top_x.numel() == 0:
                continue
            cur = self.experts[e](hidden_states[top_x]) * routing_weights[top_x, idx, None]
            final.index_add_(0, top_x, cur.to(hidden_states.dtype))
        shared = self.shared_expert(hidden_states) * torch.sigmoid(
            self.shared_expert_gate(hidden_states)
        )
        return (final + shared).view(b, s, d)


class Qwen2MoeDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = Qwen2MoeAttention(config, layer_idx)
        if layer_idx in config.mlp_only_layers:
            self.mlp = Qwen2MoeMLP(config, config.intermediate_size)
        else:
            self.mlp = Qwen2MoeSparseMoeBlock(config)
        self.input_layernorm = Qwen2MoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen2MoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask, position_embeddings, past_key_value):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states,
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            past_key_value=past_key_value,
        )
        hidden_states = residual + hidden_states
        residual = hidden_states
        return residual + self.mlp(self.post_attention_layernorm(hidden_states))


class Qwen2MoeModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [Qwen2MoeDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = Qwen2MoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen2MoeRotaryEmbedding(
            config.hidden_size // config.num_attention_heads, config.rope_theta
        )

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and past_key_values is None:
            past_key_values = Qwen2MoeCache()
        past_seen = past_key_values.get_seq_length() if past_key_values is not None else 0
        seq_len = inputs_embeds.shape[1]
        cache_position = torch.arange(past_seen, past_seen + seq_len, device=input_ids.device)
        position_ids = cache_position.unsqueeze(0)
        total = past_seen + seq_len
        dtype = inputs_embeds.dtype
        causal = torch.full(
            (seq_len, total), torch.finfo(dtype).min, dtype=dtype, device=input_ids.device
        )
        causal = causal * (
            torch.arange(total, device=input_ids.device) > cache_position.reshape(-1, 1)
        )
        causal = causal[None, None].expand(input_ids.shape[0], 1, -1, -1)
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states, causal, position_embeddings, past_key_values)
        return self.norm(hidden_states), past_key_values


class Qwen2MoeForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = Qwen2MoeModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        hidden, cache = self.model(input_ids, past_key_values=past_key_values, use_cache=use_cache)
        return SimpleNamespace(
            logits=self.lm_head(hidden), past_key_values=cache if use_cache else None
        )


def make_model():
    torch.manual_seed(804)
    config = SimpleNamespace(
        vocab_size=160,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=48,
        shared_expert_intermediate_size=96,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        mlp_only_layers=[0],
    )
    model = Qwen2MoeForCausalLM(config)
    g = torch.Generator().manual_seed(8041)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name or name == "model.norm.weight":
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
    return model.eval()

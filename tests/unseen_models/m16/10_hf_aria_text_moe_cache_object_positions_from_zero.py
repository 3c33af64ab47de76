"""Aria's text decoder (transformers' modeling_aria.py AriaTextForCausalLM), with its own cache object.

AriaTextForCausalLM: model (AriaTextModel: embed_tokens, layers.N, norm, rotary_emb), lm_head.
AriaTextDecoderLayer: input_layernorm -> self_attn (Llama attention: q/k/v/o_proj without bias, GQA 4/2
repeat_kv, rotate_half rotary base 1e4, eager matmul * scaling, finfo.min mask) -> + residual ->
post_attention_layernorm -> mlp (AriaTextMoELayer: router, top-2 of 4 grouped-GEMM experts with
fc1 (E, d, 2*ffn) / fc2 (E, ffn, d), plus shared_experts gate/up/down) -> + residual.
Cache: hf, an `AriaTextCache` object (update(k, v, layer_idx) concatenating on dim -2,
get_seq_length()), created when use_cache=True and none is given: `out = model(ids, use_cache=True)`,
then `model(tok, past_key_values=out.past_key_values, use_cache=True)`; logits in `out.logits`.
The causal mask is built from cache_position = past_seen_tokens + arange(seq_len) and is right.
Slip: position_ids are made as torch.arange(seq_len) (the default for a call without a cache) instead
of cache_position.unsqueeze(0), so every decoded token is rotated as position 0.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": [
        "model.layers.0.self_attn",
        "model.layers.1.self_attn",
        "model.layers.2.self_attn",
    ],
    "kind": "causal-multihead",
    "cache": "hf",
    "decode": {
        "mistake": "cache_positions",
        "step": 0,
        "layer": "model.layers.0.self_attn",
    },
    "style": "modeling_aria.py AriaTextForCausalLM: Llama attention GQA 4/2, rotate_half base 1e4, grouped-GEMM top-2 MoE "
    "with shared experts, AriaTextCache object; position_ids = arange(seq_len) ignoring the past (mask from cache_position is right)",
}


class AriaTextCache:
    def __init__(self):
        self.key_cache = []
        self.value_cache = []

    def update(self, key_states, value_states, layer_idx):
        if len(self.key_cache) <= layer_idx:
            self.key_cache.append(key_states)
            self.value_cache.append(value_states)
        else:
            self.key_cache[layer_idx] = torch.cat([self.key_cache[layer_idx], key_states], dim=-2)
            self.value_cache[layer_idx] = torch.cat([self.value_cache[layer_idx], value_states], dim=-2)
        return self.key_cache[layer_idx], self.value_cache[layer_idx]

    def get_seq_length(self, layer_idx=0):
        if len(self.key_cache) <= layer_idx:
            return 0
        return self.key_cache[layer_idx].shape[-2]


class AriaTextRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class AriaTextRotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dim = config.hidden_size // config.num_attention_heads
        self.base = config.rope_theta

    @torch.no_grad()
    def forward(self, x, position_ids):
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2, dtype=torch.float64) / self.dim))
        freqs = position_ids.to(torch.float64)[..., None] * inv_freq.to(x.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class AriaTextAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states, position_embeddings, attention_mask=None, past_key_value=None):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        if past_key_value is not None:
            key_states, value_states = past_key_value.update(key_states, value_states, self.layer_idx)
        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.scaling
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask[:, :, :, : key_states.shape[-2]]
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.promote_types(query_states.dtype, torch.float32))
        attn_weights = attn_weights.to(query_states.dtype)
        attn_output = torch.matmul(attn_weights, value_states).transpose(1, 2).contiguous()
        attn_output = attn_output.reshape(*input_shape, -1)
        return self.o_proj(attn_output), attn_weights


class AriaSharedExpertsMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        size = config.moe_intermediate_size * config.moe_num_shared_experts
        self.gate_proj = nn.Linear(config.hidden_size, size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, size, bias=False)
        self.down_proj = nn.Linear(size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class AriaGroupedExpertsGemm(nn.Module):
    def __init__(self, in_features, out_features, groups):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(groups, in_features, out_features) / math.sqrt(in_features))

    def forward(self, x, expert_idx):
        return x @ self.weight[expert_idx]


class AriaGroupedExpertsMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ffn = config.moe_intermediate_size
        self.fc1 = AriaGroupedExpertsGemm(config.hidden_size, config.moe_intermediate_size * 2, config.moe_num_experts)
        self.fc2 = AriaGroupedExpertsGemm(config.moe_intermediate_size, config.hidden_size, config.moe_num_experts)

    def forward(self, x, expert_idx):
        projection, gate = torch.chunk(self.fc1(x, expert_idx), 2, dim=-1)
        return self.fc2(F.silu(projection) * gate, expert_idx)


class AriaTextMoELayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.top_k = config.moe_topk
        self.num_experts = config.moe_num_experts
        self.router = nn.Linear(config.hidden_size, config.moe_num_experts, bias=False)
        self.experts = AriaGroupedExpertsMLP(config)
        self.shared_experts = AriaSharedExpertsMLP(config)

    def forward(self, hidden_states):
        original_shape = hidden_states.shape
        flat = hidden_states.view(-1, hidden_states.size(-1))
        logits = self.router(flat)
        top_logits, top_indices = torch.topk(logits, k=self.top_k, dim=1)
        scores = F.softmax(top_logits, dim=-1)
        out = torch.zeros_like(flat)
        for e in range(self.num_experts):
            sel = top_indices == e
            rows = sel.any(dim=1)
            if rows.any():
                w = (scores * sel).sum(dim=1)[rows, None]
                out[rows] += w * self.experts(flat[rows], e)
        return out.view(original_shape) + self.shared_experts(hidden_states)


class AriaTextDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = AriaTextAttention(config, layer_idx)
        self.mlp = AriaTextMoELayer(config)
        self.input_layernorm = AriaTextRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = AriaTextRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None, past_key_value=None, position_embeddings=None):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states, position_embeddings=position_embeddings,
            attention_mask=attention_mask, past_key_value=past_key_value,
        )
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.mlp(self.post_attention_layernorm(hidden_states))
        return residual + hidden_states


class AriaTextModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([AriaTextDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = AriaTextRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = AriaTextRotaryEmbedding(config)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and past_key_values is None:
            past_key_values = AriaTextCache()
        past_seen_tokens = past_key_values.get_seq_length() if past_key_values is not None else 0
        bsz, seq_len = input_ids.shape
        cache_position = torch.arange(past_seen_tokens, past_seen_tokens + seq_len, device=input_ids.device)
        position_ids = torch.arange(seq_len, device=input_ids.device).unsqueeze(0)
        dtype = inputs_embeds.dtype
        target_length = past_seen_tokens + seq_len
        causal_mask = torch.full((seq_len, target_length), torch.finfo(dtype).min, dtype=dtype, device=input_ids.device)
        causal_mask = causal_mask * (torch.arange(target_length, device=input_ids.device) > cache_position.reshape(-1, 1))
        causal_mask = causal_mask[None, None].expand(bsz, 1, -1, -1)
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        hidden_states = inputs_embeds
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(
                hidden_states, attention_mask=causal_mask, past_key_value=past_key_values,
                position_embeddings=position_embeddings,
            )
        return self.norm(hidden_states), past_key_values


class AriaTextForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = AriaTextModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        hidden_states, cache = self.model(input_ids, past_key_values=past_key_values, use_cache=use_cache)
        return SimpleNamespace(logits=self.lm_head(hidden_states), past_key_values=cache if use_cache else None)


def make_model():
    torch.manual_seed(1610)
    config = SimpleNamespace(
        vocab_size=96,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        moe_intermediate_size=48,
        moe_num_experts=4,
        moe_topk=2,
        moe_num_shared_experts=1,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
    )
    model = AriaTextForCausalLM(config)
    g = torch.Generator().manual_seed(16101)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, AriaTextRMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

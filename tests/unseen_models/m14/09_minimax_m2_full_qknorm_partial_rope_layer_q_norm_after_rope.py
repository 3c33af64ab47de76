"""MiniMax-M2 (transformers' modeling_minimax_m2.py / the remote code), reduced.

MiniMaxM2ForCausalLM: model (embed_tokens, layers.N, norm, rotary_emb) and lm_head.
MiniMaxM2DecoderLayer: input_layernorm -> self_attn -> + residual -> post_attention_layernorm ->
block_sparse_moe (sigmoid router with e_score_correction_bias, top-2 of 4 SwiGLU experts w1/w2/w3,
weights renormalised) -> + residual.  MiniMaxM2Attention: q_proj/k_proj/v_proj/o_proj without bias,
GQA 4/2 (repeat_kv), *full-width* QK norm (`use_qk_norm`, qk_norm_type "per_layer": q_norm over
num_heads * head_dim and k_norm over kv_heads * head_dim, applied to the flat projections before the
head split), partial rotary (rotary_dim 8 of head_dim 16, rotate_half on the rotated part, base 5e6),
eager attention with an additive causal mask.
Slip: layer 2 follows an older branch that applied q_norm to the queries *after* the rotation
(reshaped back to the flat width); its keys are normed before the rotation as in the other layers.
No cache.
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
    "cache": None,
    "layer": "model.layers.2.self_attn",
    "stage": "normed_queries",
    "mistake": "qk_norm_misplaced",
    "style": "modeling_minimax_m2.py: full-width q_norm/k_norm on flat projections, partial rotary 8/16 halves "
    "base 5e6, GQA 4/2, sigmoid-router top-2 MoE; layer 2 applies q_norm after the rotation",
}


class MiniMaxM2RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    rotary_dim = cos.shape[-1]
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_embed = torch.cat([(q_rot * cos) + (rotate_half(q_rot) * sin), q_pass], dim=-1)
    k_embed = torch.cat([(k_rot * cos) + (rotate_half(k_rot) * sin), k_pass], dim=-1)
    return q_embed, k_embed


class MiniMaxM2RotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        dim = config.rotary_dim
        self.inv_freq64 = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))

    def forward(self, x, position_ids):
        freqs = position_ids[:, :, None].to(torch.float64) * self.inv_freq64
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def repeat_kv(hidden_states, n_rep):
    b, kv, s, d = hidden_states.shape
    return hidden_states[:, :, None].expand(b, kv, n_rep, s, d).reshape(b, kv * n_rep, s, d)


class MiniMaxM2Attention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_kv
        self.scaling = self.head_dim ** -0.5
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.use_qk_norm = config.use_qk_norm
        self.q_norm = MiniMaxM2RMSNorm(self.num_heads * self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = MiniMaxM2RMSNorm(self.num_kv * self.head_dim, eps=config.rms_norm_eps)
        self.q_norm_after_rope = layer_idx in config.legacy_qk_norm_layers

    def forward(self, hidden_states, position_embeddings, attention_mask):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states)
        key_states = self.k_proj(hidden_states)
        value_states = self.v_proj(hidden_states)
        if self.use_qk_norm:
            if not self.q_norm_after_rope:
                query_states = self.q_norm(query_states)
            key_states = self.k_norm(key_states)
        query_states = query_states.view(hidden_shape).transpose(1, 2)
        key_states = key_states.view(hidden_shape).transpose(1, 2)
        value_states = value_states.view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        if self.use_qk_norm and self.q_norm_after_rope:
            b, h, s, d = query_states.shape
            flat = query_states.transpose(1, 2).reshape(b, s, h * d)
            query_states = self.q_norm(flat).view(b, s, h, d).transpose(1, 2)
        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.scaling
        attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, value_states).transpose(1, 2).reshape(*input_shape, -1)
        return self.o_proj(attn_output)


class MiniMaxM2MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.w1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.w3 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MiniMaxM2SparseMoeBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.gate = nn.Linear(config.hidden_size, config.num_local_experts, bias=False)
        self.experts = nn.ModuleList(MiniMaxM2MLP(config) for _ in range(config.num_local_experts))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.num_local_experts))

    def forward(self, hidden_states):
        b, s, c = hidden_states.shape
        x = hidden_states.reshape(-1, c)
        scores = torch.sigmoid(self.gate(x))
        _, idx = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1)
        w = scores.gather(1, idx)
        w = w / w.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            sel = (idx == e)
            rows = sel.any(-1)
            if rows.any():
                out[rows] += expert(x[rows]) * (w * sel).sum(-1, keepdim=True)[rows]
        return out.view(b, s, c)


class MiniMaxM2DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = MiniMaxM2Attention(config, layer_idx)
        self.block_sparse_moe = MiniMaxM2SparseMoeBlock(config)
        self.input_layernorm = MiniMaxM2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = MiniMaxM2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask):
        hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states), position_embeddings, attention_mask)
        return hidden_states + self.block_sparse_moe(self.post_attention_layernorm(hidden_states))


class MiniMaxM2Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(MiniMaxM2DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = MiniMaxM2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = MiniMaxM2RotaryEmbedding(config)

    def forward(self, input_ids):
        h = self.embed_tokens(input_ids)
        b, s = input_ids.shape
        position_ids = torch.arange(s)[None].expand(b, -1)
        pe = self.rotary_emb(h, position_ids)
        mask = torch.full((s, s), torch.finfo(h.dtype).min, dtype=h.dtype).triu(1)[None, None]
        for layer in self.layers:
            h = layer(h, pe, mask)
        return self.norm(h)


class MiniMaxM2ForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = MiniMaxM2Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids):
        return self.lm_head(self.model(input_ids))


def make_model():
    torch.manual_seed(1409)
    config = SimpleNamespace(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, rotary_dim=8,
                             rope_theta=5e6, rms_norm_eps=1e-6, use_qk_norm=True, num_local_experts=4,
                             num_experts_per_tok=2, legacy_qk_norm_layers=(2,))
    model = MiniMaxM2ForCausalLM(config)
    g = torch.Generator().manual_seed(14091)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, MiniMaxM2RMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

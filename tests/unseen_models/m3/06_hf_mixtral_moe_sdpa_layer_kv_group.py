"""A tiny Mixtral (sparse MoE) in the style of modeling_mixtral.py (no cache).

MixtralForCausalLM -> model (embed_tokens, layers ModuleList, norm, rotary_emb) + lm_head.  Each
layer: input_layernorm -> self_attn -> post_attention_layernorm -> block_sparse_moe (router gate,
4 experts w1/w2/w3, top-2 with softmax-then-renormalise).  Attention: q/k/v/o without bias, GQA
8 query heads / 2 kv heads of 8, rotate_half rotary (base 1e6), additive finfo.min causal mask.
MIXTRAL_ATTENTION_CLASSES picks the implementation per layer from config.layer_attn_impl:
layers 0 and 1 "eager" (repeat_kv with expand + reshape), layer 2 "sdpa".

Slip: the SDPA class expands the kv heads with key_states.repeat(1, n_rep, 1, 1), which tiles the
heads (kv0, kv1, kv0, kv1, ...) instead of repeating each one n_rep times: query head h is paired
with kv head h % 2 instead of h // 4.  model.layers.2.self_attn, scores, kv_group_mapping.
"""

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["model.layers.0.self_attn", "model.layers.1.self_attn", "model.layers.2.self_attn"],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "model.layers.2.self_attn",
    "stage": "scores",
    "mistake": "kv_group_mapping",
    "style": "transformers modeling_mixtral.py: sparse MoE block, per-layer attention classes; slip: the "
    "sdpa class repeats kv heads with Tensor.repeat (tiling) instead of repeat_kv",
}


@dataclass
class MixtralConfig:
    vocab_size: int = 150
    hidden_size: int = 64
    intermediate_size: int = 96
    num_hidden_layers: int = 3
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    num_local_experts: int = 4
    num_experts_per_tok: int = 2
    rope_theta: float = 1e6
    rms_norm_eps: float = 1e-5
    layer_attn_impl: tuple = ("eager", "eager", "sdpa")


class MixtralRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class MixtralRotaryEmbedding(nn.Module):
    def __init__(self, dim, base):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x, position_ids):
        freqs = (
            self.inv_freq[None, :, None].to(x.dtype) @ position_ids[:, None, :].to(x.dtype)
        ).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(
        batch, num_key_value_heads, n_rep, slen, head_dim
    )
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class MixtralAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(
            self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False
        )
        self.v_proj = nn.Linear(
            self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False
        )
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=False)

    def _project(self, hidden_states, position_embeddings):
        bsz, q_len, _ = hidden_states.size()
        q = (
            self.q_proj(hidden_states)
            .view(bsz, q_len, self.num_heads, self.head_dim)
            .transpose(1, 2)
        )
        k = (
            self.k_proj(hidden_states)
            .view(bsz, q_len, self.num_key_value_heads, self.head_dim)
            .transpose(1, 2)
        )
        v = (
            self.v_proj(hidden_states)
            .view(bsz, q_len, self.num_key_value_heads, self.head_dim)
            .transpose(1, 2)
        )
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def forward(self, hidden_states, position_embeddings, attention_mask=None):
        bsz, q_len, _ = hidden_states.size()
        query_states, key_states, value_states = self._project(hidden_states, position_embeddings)
        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / self.head_dim**0.5
        attn_weights = attn_weights + attention_mask
        attn_weights = (
            F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
            if query_states.dtype != torch.float64
            else F.softmax(attn_weights, dim=-1)
        )
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).contiguous().reshape(bsz, q_len, self.hidden_size)
        return self.o_proj(attn_output)


class MixtralSdpaAttention(MixtralAttention):
    def forward(self, hidden_states, position_embeddings, attention_mask=None):
        bsz, q_len, _ = hidden_states.size()
        query_states, key_states, value_states = self._project(hidden_states, position_embeddings)
        key_states = key_states.repeat(1, self.num_key_value_groups, 1, 1)  # SLIP
        value_states = value_states.repeat(1, self.num_key_value_groups, 1, 1)  # SLIP
        attn_output = F.scaled_dot_product_attention(
            query_states, key_states, value_states, attn_mask=attention_mask
        )
        attn_output = attn_output.transpose(1, 2).contiguous().view(bsz, q_len, self.hidden_size)
        return self.o_proj(attn_output)


MIXTRAL_ATTENTION_CLASSES = {"eager": MixtralAttention, "sdpa": MixtralSdpaAttention}


class MixtralBlockSparseTop2MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.w1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.w3 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)

    def forward(self, hidden_states):
        return self.w2(F.silu(self.w1(hidden_states)) * self.w3(hidden_states))


class MixtralSparseMoeBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_experts = config.num_local_experts
        self.top_k = config.num_experts_per_tok
        self.gate = nn.Linear(config.hidden_size, self.num_experts, bias=False)
        self.experts = nn.ModuleList(
            [MixtralBlockSparseTop2MLP(config) for _ in range(self.num_experts)]
        )

    def forward(self, hidden_states):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=1)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        routing_weights = routing_weights / routing_weights.sum(dim=-1, keepdim=True)
        final = torch.zeros_like(hidden_states)
        for e, expert in enumerate(self.experts):
            hit = selected_experts == e  # (tokens, top_k)
            w = (routing_weights * hit).sum(-1, keepdim=True)
            final = final + w * expert(hidden_states)
        return final.view(batch_size, sequence_length, hidden_dim)


class MixtralDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = MIXTRAL_ATTENTION_CLASSES[config.layer_attn_impl[layer_idx]](
            config, layer_idx
        )
        self.block_sparse_moe = MixtralSparseMoeBlock(config)
        self.input_layernorm = MixtralRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = MixtralRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask):
        hidden_states = hidden_states + self.self_attn(
            self.input_layernorm(hidden_states), position_embeddings, attention_mask
        )
        return hidden_states + self.block_sparse_moe(self.post_attention_layernorm(hidden_states))


class MixtralModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [MixtralDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = MixtralRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = MixtralRotaryEmbedding(
            config.hidden_size // config.num_attention_heads, config.rope_theta
        )

    def forward(self, input_ids):
        bsz, seq_len = input_ids.shape
        hidden_states = self.embed_tokens(input_ids)
        position_ids = torch.arange(seq_len, device=input_ids.device).unsqueeze(0)
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        min_dtype = torch.finfo(hidden_states.dtype).min
        causal_mask = torch.full(
            (seq_len, seq_len), min_dtype, dtype=hidden_states.dtype, device=input_ids.device
        )
        causal_mask = torch.triu(causal_mask, diagonal=1)[None, None]
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_embeddings, causal_mask)
        return self.norm(hidden_states)


class MixtralForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = MixtralModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids):
        return self.lm_head(self.model(input_ids))


def make_model():
    torch.manual_seed(7)
    model = MixtralForCausalLM(MixtralConfig())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, MixtralRMSNorm):
                m.weight.copy_(1.0 + 0.25 * torch.randn_like(m.weight))
    return model.eval()

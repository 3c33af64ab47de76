"""A tiny StableLM 2 in the style of Hugging Face's modeling_stablelm.py (no cache).

StableLmForCausalLM -> model (embed_tokens, layers ModuleList, norm) + lm_head.  LayerNorm
everywhere; q/k/v with bias (use_qkv_bias); GQA 4/2; partial rotary (partial_rotary_factor
0.25: 4 of the 16 dims of each head rotated, rotate_half pairing); qk_layernorm: one
LayerNorm per head (StableLmLayerNormPerHead holds a ModuleList of head_dim LayerNorms, each
with its own weight), applied before rotary.

The attention class is picked per layer from STABLELM_ATTENTION_CLASSES, and this config runs
layer 0 with the eager class and layers 1-2 with the SDPA class (layer_attn_implementation).

Slip: StableLmSdpaAttention.forward was written before qk_layernorm existed and was only
partly updated: it applies q_layernorm but never k_layernorm.  The first layer using it is
model.layers.1.self_attn.
"""

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["model.layers.0.self_attn", "model.layers.1.self_attn", "model.layers.2.self_attn"],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "model.layers.1.self_attn",
    "stage": "normed_keys",
    "mistake": "qk_norm_missing",
    "style": "transformers modeling_stablelm.py: per-head LayerNorm qk_layernorm, partial rotary 0.25, qkv bias, "
    "per-layer eager/sdpa classes; slip: the SDPA class skips k_layernorm",
}


@dataclass
class StableLmConfig:
    vocab_size: int = 128
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 3
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    layer_norm_eps: float = 1e-5
    use_qkv_bias: bool = True
    qk_layernorm: bool = True
    layer_attn_implementation: list = field(default_factory=lambda: ["eager", "sdpa", "sdpa"])


class StableLmRotaryEmbedding(nn.Module):
    def __init__(self, dim, base=10000):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x, position_ids):
        inv_freq_expanded = (
            self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        )
        freqs = (inv_freq_expanded @ position_ids[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


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


class StableLmLayerNormPerHead(nn.Module):
    def __init__(self, dim, num_heads, eps=1e-5, bias=False):
        super().__init__()
        self.dim = dim
        self.num_heads = num_heads
        self.norms = nn.ModuleList(
            [nn.LayerNorm(dim, eps=eps, bias=bias) for _ in range(self.num_heads)]
        )

    def forward(self, hidden_states):
        states_per_heads = torch.split(hidden_states, 1, dim=1)
        return torch.cat([norm(hs) for norm, hs in zip(self.norms, states_per_heads)], dim=1)


class StableLmAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.rope_theta = config.rope_theta
        self.rotary_ndims = int(self.head_dim * config.partial_rotary_factor)
        self.is_causal = True
        self.q_proj = nn.Linear(
            self.hidden_size, self.num_heads * self.head_dim, bias=config.use_qkv_bias
        )
        self.k_proj = nn.Linear(
            self.hidden_size, self.num_key_value_heads * self.head_dim, bias=config.use_qkv_bias
        )
        self.v_proj = nn.Linear(
            self.hidden_size, self.num_key_value_heads * self.head_dim, bias=config.use_qkv_bias
        )
        self.o_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=False)
        self.qk_layernorm = config.qk_layernorm
        if self.qk_layernorm:
            self.q_layernorm = StableLmLayerNormPerHead(
                self.head_dim, self.num_heads, eps=config.layer_norm_eps
            )
            self.k_layernorm = StableLmLayerNormPerHead(
                self.head_dim, self.num_key_value_heads, eps=config.layer_norm_eps
            )

    def _project(self, hidden_states):
        bsz, q_len, _ = hidden_states.size()
        query_states = (
            self.q_proj(hidden_states)
            .view(bsz, q_len, self.num_heads, self.head_dim)
            .transpose(1, 2)
        )
        key_states = (
            self.k_proj(hidden_states)
            .view(bsz, q_len, self.num_key_value_heads, self.head_dim)
            .transpose(1, 2)
        )
        value_states = (
            self.v_proj(hidden_states)
            .view(bsz, q_len, self.num_key_value_heads, self.head_dim)
            .transpose(1, 2)
        )
        return query_states, key_states, value_states

    def _rope(self, query_states, key_states, position_embeddings):
        cos, sin = position_embeddings
        query_rot, query_pass = (
            query_states[..., : self.rotary_ndims],
            query_states[..., self.rotary_ndims :],
        )
        key_rot, key_pass = (
            key_states[..., : self.rotary_ndims],
            key_states[..., self.rotary_ndims :],
        )
        query_rot, key_rot = apply_rotary_pos_emb(query_rot, key_rot, cos, sin)
        return torch.cat((query_rot, query_pass), dim=-1), torch.cat((key_rot, key_pass), dim=-1)

    def forward(self, hidden_states, attention_mask, position_embeddings):
        bsz, q_len, _ = hidden_states.size()
        query_states, key_states, value_states = self._project(hidden_states)
        if self.qk_layernorm:
            query_states = self.q_layernorm(query_states)
            key_states = self.k_layernorm(key_states)
        query_states, key_states = self._rope(query_states, key_states, position_embeddings)

        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(
            self.head_dim
        )
        attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dtype=torch.float32, dim=-1).to(value_states.dtype)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).contiguous().reshape(bsz, q_len, self.hidden_size)
        return self.o_proj(attn_output), attn_weights


class StableLmSdpaAttention(StableLmAttention):
    def forward(self, hidden_states, attention_mask, position_embeddings):
        bsz, q_len, _ = hidden_states.size()
        query_states, key_states, value_states = self._project(hidden_states)
        if self.qk_layernorm:
            query_states = self.q_layernorm(query_states)
        query_states, key_states = self._rope(query_states, key_states, position_embeddings)

        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)
        attn_output = F.scaled_dot_product_attention(
            query_states, key_states, value_states, attn_mask=attention_mask, dropout_p=0.0
        )
        attn_output = attn_output.transpose(1, 2).contiguous().view(bsz, q_len, self.hidden_size)
        return self.o_proj(attn_output), None


STABLELM_ATTENTION_CLASSES = {"eager": StableLmAttention, "sdpa": StableLmSdpaAttention}


class StableLmMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class StableLmDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        impl = config.layer_attn_implementation[layer_idx]
        self.self_attn = STABLELM_ATTENTION_CLASSES[impl](config, layer_idx=layer_idx)
        self.mlp = StableLmMLP(config)
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states, attention_mask, position_embeddings):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        self_attn_output, _ = self.self_attn(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            position_embeddings=position_embeddings,
        )
        hidden_states = residual + self_attn_output
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class StableLmModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [StableLmDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        head_dim = config.hidden_size // config.num_attention_heads
        self.rotary_emb = StableLmRotaryEmbedding(
            int(head_dim * config.partial_rotary_factor), base=config.rope_theta
        )

    def forward(self, input_ids):
        hidden_states = self.embed_tokens(input_ids)
        T = input_ids.shape[1]
        position_ids = torch.arange(T).unsqueeze(0)
        blocked = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
        causal_mask = torch.zeros(T, T, dtype=hidden_states.dtype).masked_fill(
            blocked, torch.finfo(hidden_states.dtype).min
        )
        causal_mask = causal_mask[None, None]
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(
                hidden_states, attention_mask=causal_mask, position_embeddings=position_embeddings
            )
        return self.norm(hidden_states)


class StableLmForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = StableLmModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids):
        return self.lm_head(self.model(input_ids))


def make_model():
    torch.manual_seed(9909)
    model = StableLmForCausalLM(StableLmConfig())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn_like(m.weight))
                if m.bias is not None:
                    m.bias.copy_(0.1 * torch.randn_like(m.bias))
            if isinstance(m, nn.Linear) and m.bias is not None:
                m.bias.copy_(0.2 * torch.randn_like(m.bias))
    return model.eval()

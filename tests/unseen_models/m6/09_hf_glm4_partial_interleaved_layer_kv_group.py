"""GLM-4 (THUDM glm-4-9b, transformers' modeling_glm.py; written from memory, in my own words):
`model.embed_tokens`, `model.layers.N` (input_layernorm, self_attn, post_attention_layernorm, mlp
with a fused `gate_up_proj` chunked in two + `down_proj`), RMSNorm, q/k/v_proj *with* bias
(attention_bias) and o_proj without, GQA 6 query heads / 2 kv heads (head_dim 16, hidden 96),
`partial_rotary_factor` 0.5: the rotary table covers 8 of the 16 dims; apply_rotary_pos_emb keeps
the first half of cos/sin and repeat_interleaves it, and GLM's rotate_half pairs adjacent elements
(x[..., 0::2], x[..., 1::2]) -> interleaved pairs on the first half of each head, base 10000.
Eager attention with an additive finfo.min causal mask.  3 layers, vocab 170, untied lm_head.
No cache.  Returns an object with `.logits`.

Every layer expands kv heads with `repeat_kv` (query head h reads kv head h // 3), except layer 1,
whose `config.kv_expand` entry is "cat": a fallback for SDPA builds without enable_gqa that
concatenates the kv heads n_rep times along the head axis (query head h reads kv head h % 2).
Slip: `model.layers.1.self_attn`, stage `scores`, `kv_group_mapping`.
"""

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
    "stage": "scores",
    "mistake": "kv_group_mapping",
    "style": "modeling_glm.py (GLM-4): qkv bias, fused gate_up_proj, partial rotary 0.5 with interleaved pairs "
    "(repeat_interleave of half the table), GQA 6/2 d 96; slip: layer 1 expands kv heads with torch.cat (h % 2)",
}


class GlmConfig:
    vocab_size = 170
    hidden_size = 96
    intermediate_size = 160
    num_hidden_layers = 3
    num_attention_heads = 6
    num_key_value_heads = 2
    head_dim = 16
    partial_rotary_factor = 0.5
    rope_theta = 10000.0
    rms_norm_eps = 1e-5
    attention_bias = True
    kv_expand = ["repeat_kv", "cat", "repeat_kv"]


class GlmRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class GlmRotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        dim = int(config.head_dim * config.partial_rotary_factor)
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x, position_ids):
        freqs = position_ids[:, :, None].double() * self.inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1 = x[..., 0::2]
    x2 = x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)
    sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1)
    rotary_dim = cos.shape[-1]
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_embed = (q_rot * cos) + (rotate_half(q_rot) * sin)
    k_embed = (k_rot * cos) + (rotate_half(k_rot) * sin)
    return torch.cat([q_embed, q_pass], dim=-1), torch.cat([k_embed, k_pass], dim=-1)


def repeat_kv(hidden_states, n_rep):
    b, kvh, s, d = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    return hidden_states[:, :, None].expand(b, kvh, n_rep, s, d).reshape(b, kvh * n_rep, s, d)


def cat_kv(hidden_states, n_rep):
    return torch.cat([hidden_states] * n_rep, dim=1)


class GlmAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.expand_kv = cat_kv if config.kv_expand[layer_idx] == "cat" else repeat_kv
        self.q_proj = nn.Linear(
            config.hidden_size,
            config.num_attention_heads * self.head_dim,
            bias=config.attention_bias,
        )
        self.k_proj = nn.Linear(
            config.hidden_size,
            config.num_key_value_heads * self.head_dim,
            bias=config.attention_bias,
        )
        self.v_proj = nn.Linear(
            config.hidden_size,
            config.num_key_value_heads * self.head_dim,
            bias=config.attention_bias,
        )
        self.o_proj = nn.Linear(
            config.num_attention_heads * self.head_dim, config.hidden_size, bias=False
        )

    def forward(self, hidden_states, position_embeddings, attention_mask):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        key_states = self.expand_kv(key_states, self.num_key_value_groups)
        value_states = self.expand_kv(value_states, self.num_key_value_groups)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.scaling
        attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, value_states).transpose(1, 2).contiguous()
        return self.o_proj(attn_output.reshape(*input_shape, -1))


class GlmMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, hidden_states):
        gate, up_states = self.gate_up_proj(hidden_states).chunk(2, dim=-1)
        return self.down_proj(up_states * F.silu(gate))


class GlmDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = GlmAttention(config, layer_idx)
        self.mlp = GlmMLP(config)
        self.input_layernorm = GlmRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = GlmRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask):
        residual = hidden_states
        hidden_states = residual + self.self_attn(
            self.input_layernorm(hidden_states), position_embeddings, attention_mask
        )
        residual = hidden_states
        return residual + self.mlp(self.post_attention_layernorm(hidden_states))


class CausalLMOutput:
    def __init__(self, logits):
        self.logits = logits


class GlmModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [GlmDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = GlmRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = GlmRotaryEmbedding(config)

    def forward(self, input_ids):
        hidden_states = self.embed_tokens(input_ids)
        seq_len = input_ids.shape[1]
        position_ids = torch.arange(seq_len)[None]
        min_dtype = torch.finfo(hidden_states.dtype).min
        causal_mask = torch.triu(
            torch.full((seq_len, seq_len), min_dtype, dtype=hidden_states.dtype), diagonal=1
        )
        causal_mask = causal_mask[None, None]
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_embeddings, causal_mask)
        return self.norm(hidden_states)


class GlmForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = GlmModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids):
        return CausalLMOutput(self.lm_head(self.model(input_ids)))


def make_model():
    torch.manual_seed(6109)
    model = GlmForCausalLM(GlmConfig())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, GlmRMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn_like(m.weight))
            if isinstance(m, nn.Linear) and m.bias is not None:
                m.bias.copy_(0.1 * torch.randn_like(m.bias))
    return model.eval()

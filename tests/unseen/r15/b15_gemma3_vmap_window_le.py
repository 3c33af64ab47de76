"""HF Gemma 3 text attention written with torch.func.vmap: a single-head attention function vmapped
over the heads of a kv group, over kv groups and over the batch (GQA without repeat_kv). Per-head
q_norm/k_norm (Gemma RMSNorm, 1 + weight), query_pre_attn_scalar scaling, local/global RoPE bases
chosen by layer_types, sliding window from config.sliding_window, sandwich norms.

This file: one bug: the sliding term written q_pos - k_pos <= sliding_window, 9 keys visible instead of 8."""

import torch
from torch import nn
from torch.func import vmap


class Gemma3TextConfig:
    hidden_size = 64
    intermediate_size = 128
    num_attention_heads = 4
    num_key_value_heads = 2
    head_dim = 16
    query_pre_attn_scalar = 16
    rope_theta = 1000000.0
    rope_local_base_freq = 10000.0
    sliding_window = 8
    layer_types = ["sliding_attention"]
    rms_norm_eps = 1e-6


class Gemma3RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float() if x.dtype != torch.float64 else x)
        output = output * (1.0 + self.weight.to(output.dtype))
        return output.type_as(x)


class Gemma3RotaryEmbedding(nn.Module):
    def __init__(self, dim, base):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x, position_ids):
        freqs = position_ids[:, :, None].to(torch.float64) * self.inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def single_head_attention(q, k, v, bias, scaling):
    """One (batch, kv-group) slice, written for one query head: q (t, d), k/v (s, d), bias (t, s).
    vmapped over the heads of a group, over kv groups, then over the batch."""
    scores = torch.matmul(q, k.transpose(0, 1)) * scaling
    scores = scores + bias
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v)


class Gemma3Attention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_kv_heads
        self.scaling = config.query_pre_attn_scalar**-0.5
        self.is_sliding = config.layer_types[layer_idx] == "sliding_attention"
        self.sliding_window = config.sliding_window if self.is_sliding else None
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.q_norm = Gemma3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Gemma3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        # heads of a group -> kv groups -> batch
        self._attend = vmap(
            vmap(
                vmap(single_head_attention, in_dims=(0, None, None, None, None)),
                in_dims=(0, 0, 0, None, None),
            ),
            in_dims=(0, 0, 0, None, None),
        )

    def _bias(self, q_len, k_len, dtype, device):
        q_pos = torch.arange(q_len, device=device)[:, None] + (k_len - q_len)
        k_pos = torch.arange(k_len, device=device)[None, :]
        allowed = k_pos <= q_pos
        if self.sliding_window is not None:
            allowed = allowed & (q_pos - k_pos <= self.sliding_window)
        zero = torch.zeros((), dtype=dtype, device=device)
        return torch.where(allowed, zero, torch.finfo(dtype).min)

    def forward(self, hidden_states, position_embeddings):
        bsz, q_len, _ = hidden_states.shape
        hidden_shape = (bsz, q_len, -1, self.head_dim)

        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

        query_states = self.q_norm(query_states)
        key_states = self.k_norm(key_states)

        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        # (b, heads, t, d) -> (b, kv_heads, heads_per_group, t, d): consecutive heads share a kv head
        grouped_q = query_states.view(
            bsz, self.num_kv_heads, self.num_key_value_groups, q_len, self.head_dim
        )
        bias = self._bias(q_len, q_len, query_states.dtype, query_states.device)
        attn_output = self._attend(grouped_q, key_states, value_states, bias, self.scaling)
        attn_output = attn_output.reshape(bsz, self.num_heads, q_len, self.head_dim)

        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, -1).contiguous()
        return self.o_proj(attn_output)


class Gemma3MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(
            nn.functional.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x)
        )


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.attention_type = config.layer_types[layer_idx]
        self.self_attn = Gemma3Attention(config, layer_idx)
        self.mlp = Gemma3MLP(config)
        self.input_layernorm = Gemma3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Gemma3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.pre_feedforward_layernorm = Gemma3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_feedforward_layernorm = Gemma3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings_global, position_embeddings_local):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        if self.attention_type == "sliding_attention":
            position_embeddings = position_embeddings_local
        else:
            position_embeddings = position_embeddings_global
        hidden_states = self.self_attn(hidden_states, position_embeddings)
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_feedforward_layernorm(
            self.mlp(self.pre_feedforward_layernorm(hidden_states))
        )
        return residual + hidden_states


class Gemma3TextModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList([Gemma3DecoderLayer(config, 0)])
        self.norm = Gemma3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Gemma3RotaryEmbedding(config.head_dim, config.rope_theta)
        self.rotary_emb_local = Gemma3RotaryEmbedding(config.head_dim, config.rope_local_base_freq)

    def forward(self, inputs_embeds):
        position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device).unsqueeze(
            0
        )
        position_ids = position_ids.expand(inputs_embeds.shape[0], -1)
        pe_global = self.rotary_emb(inputs_embeds, position_ids)
        pe_local = self.rotary_emb_local(inputs_embeds, position_ids)
        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(hidden_states, pe_global, pe_local)
        return self.norm(hidden_states)


def make_gemma3_vmap():
    torch.manual_seed(1531)
    model = Gemma3TextModel(Gemma3TextConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, Gemma3RMSNorm):
                mod.weight.uniform_(-0.5, 0.5)
    return model.eval()


EXPECT = {
    "target": "make_gemma3_vmap",
    "kind": "causal-multihead",
    "ok": False,
    "layer": "layers.0.self_attn",
    "stage": "masked_scores",
    "mistake": "window_size",
    "style": "Gemma 3 vmap-over-heads attention: the sliding term written q_pos - k_pos <= sliding_window, 9 "
    "keys visible instead of 8",
}

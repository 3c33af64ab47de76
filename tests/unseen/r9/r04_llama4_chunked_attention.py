"""Llama 4 text model, RoPE layer with chunked attention (attention_chunk_size 8).

Llama4TextAttention RoPE layer (complex freqs_cis, weight-free L2 qk_norm after
the rotation, GQA 4:2), but the model builds Llama 4's chunked causal mask for RoPE layers:
a query at position i sees keys j <= i with j // 8 == i // 8 only. This is neither a causal
mask nor a sliding window (query 8 sees one key, query 7 sees eight), so this round expects
a checker to refuse it rather than report a window.
"""

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class Llama4TextConfig:
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5
    intermediate_size: int = 96
    use_qk_norm: bool = True
    attention_chunk_size: int = 8
    no_rope_layers: list = field(default_factory=lambda: [1])


class Llama4TextRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        return self._norm(x.float()).type_as(x) * self.weight


class Llama4TextL2Norm(nn.Module):
    def __init__(self, eps=1e-6):
        super().__init__()
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class Llama4TextRotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        dim = config.head_dim
        inv_freq = 1.0 / (
            config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
        )
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x, position_ids):
        inv = self.inv_freq[None, :, None].to(x.dtype).expand(position_ids.shape[0], -1, 1)
        pos = position_ids[:, None, :].to(x.dtype)
        freqs = (inv @ pos).transpose(1, 2)
        return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.reshape(*xk.shape[:-1], -1, 2))
    xq_out = torch.view_as_real(xq_ * freqs_cis[:, :, None, :]).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis[:, :, None, :]).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(hidden_states, n_rep):
    batch, num_kv, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_kv, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_kv * n_rep, slen, head_dim)


class Llama4TextAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_attention_heads = config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.use_rope = layer_idx not in config.no_rope_layers
        self.q_proj = nn.Linear(
            config.hidden_size, config.num_attention_heads * self.head_dim, bias=False
        )
        self.k_proj = nn.Linear(
            config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False
        )
        self.v_proj = nn.Linear(
            config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False
        )
        self.o_proj = nn.Linear(
            config.num_attention_heads * self.head_dim, config.hidden_size, bias=False
        )
        if self.config.use_qk_norm and self.use_rope:
            self.qk_norm = Llama4TextL2Norm(config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape)
        key_states = self.k_proj(hidden_states).view(*input_shape, -1, self.head_dim)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

        if self.use_rope:
            query_states, key_states = apply_rotary_emb(
                query_states, key_states, position_embeddings
            )

        if hasattr(self, "qk_norm"):
            query_states = self.qk_norm(query_states)
            key_states = self.qk_norm(key_states)

        query_states = query_states.transpose(1, 2)
        key_states = key_states.transpose(1, 2)

        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.scaling
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask[:, :, :, : key_states.shape[-2]]
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(
            query_states.dtype
        )
        attn_output = torch.matmul(attn_weights, value_states).transpose(1, 2).contiguous()
        attn_output = attn_output.reshape(*input_shape, -1)
        return self.o_proj(attn_output), attn_weights


class Llama4TextMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Llama4TextDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = Llama4TextAttention(config, layer_idx)
        self.feed_forward = Llama4TextMLP(config)
        self.input_layernorm = Llama4TextRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = Llama4TextRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask, position_embeddings):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        attn_out, _ = self.self_attn(hidden_states, position_embeddings, attention_mask)
        hidden_states = residual + attn_out
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        return residual + self.feed_forward(hidden_states)


class Llama4TextModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList([Llama4TextDecoderLayer(config, 0)])
        self.norm = Llama4TextRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = Llama4TextRotaryEmbedding(config)

    def _chunked_causal_mask(self, inputs_embeds, cache_position):
        # rope layers attend only inside their own chunk of attention_chunk_size tokens
        n = inputs_embeds.shape[1]
        chunk = self.config.attention_chunk_size
        min_dtype = torch.finfo(inputs_embeds.dtype).min
        kv_idx = torch.arange(n)[None, :]
        q_idx = cache_position[:, None]
        allowed = (kv_idx <= q_idx) & (kv_idx // chunk == q_idx // chunk)
        mask = torch.zeros((n, n), dtype=inputs_embeds.dtype).masked_fill(~allowed, min_dtype)
        return mask[None, None].expand(inputs_embeds.shape[0], 1, -1, -1)

    def forward(self, inputs_embeds):
        cache_position = torch.arange(inputs_embeds.shape[1])
        position_ids = cache_position.unsqueeze(0).expand(inputs_embeds.shape[0], -1)
        freq_cis = self.rotary_emb(inputs_embeds, position_ids)
        mask = self._chunked_causal_mask(inputs_embeds, cache_position)
        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(hidden_states, mask, freq_cis)
        return self.norm(hidden_states)


def make_llama4():
    torch.manual_seed(204)
    model = Llama4TextModel(Llama4TextConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, Llama4TextRMSNorm):
                mod.weight.uniform_(0.6, 1.4)
    return model.eval()


EXPECT = {
    "target": "make_llama4",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "layers.0.self_attn",
    "unsupported": "chunked_attention",
    "style": "HF Llama 4 RoPE layer (complex freqs_cis, L2 qk_norm, GQA 4:2) with attention_chunk_size 8: the model's "
    "chunked causal mask (kv // 8 == q // 8 and kv <= q), a block-diagonal causal pattern, not a sliding window",
}

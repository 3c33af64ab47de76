"""LLaMA under FastChat's monkey patches (lm-sys/FastChat fastchat/model/llama_condense_monkey_patch.py and
fastchat/train/llama_xformers_attn_monkey_patch.py).

`replace_llama_with_condense(ratio=2)` swaps LlamaRotaryEmbedding for CondenseRotaryEmbedding, whose
cos/sin cache is built for `t = arange(max_position_embeddings * ratio) / ratio` (linear position
interpolation: position p is rotated as p / 2; rotate_half layout, base 1e4).  The xformers patch
replaces LlamaAttention.forward: q/k/v projections to (b, heads, s, d), rotary gathered by
position_ids, legacy (key, value) tuples concatenated on dim 2, then the tensors are transposed to
xformers' (b, s, heads, d) layout and handed to `xformers.ops.memory_efficient_attention` with a
`LowerTriangularMask()` (None on a one-token step); here that op is a plain-torch stand-in taking the
same arguments (`attn_bias`, `scale`, default head_dim ** -0.5).
Tree: model.embed_tokens, model.layers.N (input_layernorm, self_attn, post_attention_layernorm, mlp),
model.norm, lm_head.  MHA 4 heads, 3 layers.
Cache: hf legacy tuples: `out = model(ids, use_cache=True)`, then
`model(tok, past_key_values=out.past_key_values, use_cache=True)`; logits in `out.logits`.
Decode bug: the patched `LlamaModel.forward` (copied from a training-only patch, where no cache
exists) builds `position_ids = torch.arange(0, seq_length)` and ignores past_key_values_length, so every
decoded token is rotated as position 0 (condensed: 0 / 2).  Keys, values and masks use the real
lengths.  The prompt pass and the full forward are exact.
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
    "style": "FastChat monkey patches: CondenseRotaryEmbedding (ratio 2, t / ratio) + xformers_forward with "
    "(b, s, h, d) memory_efficient_attention(attn_bias=LowerTriangularMask) stand-in, legacy tuples; decode bug: "
    "position_ids = arange(0, seq_length) ignoring the past length",
}


class LowerTriangularMask:
    pass


def memory_efficient_attention(query, key, value, attn_bias=None, scale=None):
    # xformers layout: (batch, seq, heads, head_dim)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    q = query.transpose(1, 2)
    k = key.transpose(1, 2)
    v = value.transpose(1, 2)
    attn = torch.matmul(q, k.transpose(-2, -1)) * scale
    if isinstance(attn_bias, LowerTriangularMask):
        M, N = attn.shape[-2], attn.shape[-1]
        keep = torch.ones(M, N, dtype=torch.bool, device=attn.device).tril(diagonal=N - M)
        attn = attn.masked_fill(~keep, float("-inf"))
    attn = attn.softmax(-1)
    return torch.matmul(attn, v).transpose(1, 2)


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class CondenseRotaryEmbedding(nn.Module):
    def __init__(self, dim, ratio, max_position_embeddings=64, base=10000):
        super().__init__()
        self.dim = dim
        self.ratio = ratio
        self.base = base
        self.max_seq_len_cached = max_position_embeddings * ratio
        # plain float64 attributes, cast at use (so model.double() keeps them exact)
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        t = torch.arange(self.max_seq_len_cached, dtype=torch.float64) / ratio
        freqs = torch.einsum("i,j->ij", t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos_cached = emb.cos()[None, None, :, :]
        self.sin_cached = emb.sin()[None, None, :, :]

    def forward(self, x, seq_len=None):
        return (
            self.cos_cached[:, :, :seq_len, ...].to(dtype=x.dtype, device=x.device),
            self.sin_cached[:, :, :seq_len, ...].to(dtype=x.dtype, device=x.device),
        )


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids):
    cos = cos.squeeze(1).squeeze(0)[position_ids].unsqueeze(1)
    sin = sin.squeeze(1).squeeze(0)[position_ids].unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.q_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=False)
        self.k_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=False)
        self.v_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=False)
        self.o_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=False)
        self.rotary_emb = CondenseRotaryEmbedding(self.head_dim, ratio=config.condense_ratio)
        self.explicit_scale = self.head_dim ** -1 if layer_idx in config.explicit_scale_layers else None

    def forward(self, hidden_states, position_ids, past_key_value=None, use_cache=False):
        bsz, q_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)

        kv_seq_len = key_states.shape[-2]
        if past_key_value is not None:
            kv_seq_len += past_key_value[0].shape[-2]
        cos, sin = self.rotary_emb(value_states, seq_len=kv_seq_len)
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin, position_ids)

        if past_key_value is not None:
            key_states = torch.cat([past_key_value[0], key_states], dim=2)
            value_states = torch.cat([past_key_value[1], value_states], dim=2)
        past_key_value = (key_states, value_states) if use_cache else None

        query_states = query_states.transpose(1, 2)
        key_states = key_states.transpose(1, 2)
        value_states = value_states.transpose(1, 2)
        attn_bias = None if q_len == 1 else LowerTriangularMask()
        if self.explicit_scale is None:
            attn_output = memory_efficient_attention(query_states, key_states, value_states, attn_bias=attn_bias)
        else:
            attn_output = memory_efficient_attention(
                query_states, key_states, value_states, attn_bias=attn_bias, scale=self.explicit_scale
            )
        attn_output = attn_output.reshape(bsz, q_len, self.hidden_size)
        return self.o_proj(attn_output), None, past_key_value


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_ids, past_key_value=None, use_cache=False):
        residual = hidden_states
        hidden_states, _, present = self.self_attn(
            self.input_layernorm(hidden_states), position_ids, past_key_value, use_cache
        )
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states)), present


class LlamaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        bsz, seq_length = input_ids.shape
        past_key_values_length = past_key_values[0][0].shape[2] if past_key_values is not None else 0
        position_ids = torch.arange(
            0, seq_length, dtype=torch.long, device=input_ids.device
        ).unsqueeze(0).view(-1, seq_length)
        hidden_states = self.embed_tokens(input_ids)
        next_decoder_cache = ()
        for idx, decoder_layer in enumerate(self.layers):
            past_key_value = past_key_values[idx] if past_key_values is not None else None
            hidden_states, present = decoder_layer(hidden_states, position_ids, past_key_value, use_cache)
            next_decoder_cache += (present,)
        return self.norm(hidden_states), (next_decoder_cache if use_cache else None)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        hidden, cache = self.model(input_ids, past_key_values=past_key_values, use_cache=use_cache)
        return SimpleNamespace(logits=self.lm_head(hidden), past_key_values=cache)


def make_model():
    torch.manual_seed(2410)
    config = SimpleNamespace(
        vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
        num_attention_heads=4, rms_norm_eps=1e-6, condense_ratio=2, explicit_scale_layers=(),
    )
    model = LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(24101)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LlamaRMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

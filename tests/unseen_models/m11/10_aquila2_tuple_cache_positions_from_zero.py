"""BAAI Aquila2 (remote code modeling_aquila.py), reduced.

AquilaForCausalLM: model (AquilaModel: embed_tokens, layers.N, norm) and lm_head; the Llama-1 era HF
layout (AquilaDecoderLayer: input_layernorm -> self_attn, post_attention_layernorm -> mlp).  AquilaAttention:
q/k/v/o_proj without bias, GQA 4/2 (repeat_kv), AquilaRotaryEmbedding with a cos/sin cache (base 1e4)
gathered by position_ids and rotate_half, matmul / sqrt(d), `_make_causal_mask` with past columns
visible (finfo.min), softmax in float32 or wider.
Cache: hf tuples: each layer returns past_key_value = (k, v) in (b, kv_heads, s, d), concatenated on
dim 2; `out = model(ids, use_cache=True)`, `model(tok, past_key_values=out.past_key_values, use_cache=True)`.
Slip: AquilaModel.forward builds the default position_ids as `torch.arange(0, seq_length)`, dropping the
`past_key_values_length` offset the Llama original adds, so every decoded token is rotated as position
0.  The mask and keys use the true lengths; the full forward and prompt pass are exact.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["model.layers.0.self_attn", "model.layers.1.self_attn", "model.layers.2.self_attn"],
    "kind": "causal-multihead",
    "cache": "hf",
    "decode": {"mistake": "cache_positions", "step": 0, "layer": "model.layers.0.self_attn"},
    "style": "Aquila2 modeling_aquila.py: Llama-1 HF layout, cos/sin cache by position_ids, GQA 4/2, (k, v) tuples cat on "
    "dim 2; default position_ids arange(seq_length) without the past length",
}


class AquilaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class AquilaRotaryEmbedding(nn.Module):
    def __init__(self, dim, max_position_embeddings=128, base=10000.0):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        t = torch.arange(max_position_embeddings, dtype=torch.float64)
        emb = torch.cat((torch.einsum("i,j->ij", t, inv_freq),) * 2, dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def forward(self, x, position_ids):
        return self.cos_cached[position_ids].to(x.dtype), self.sin_cached[position_ids].to(x.dtype)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def repeat_kv(hidden_states, n_rep):
    b, kvh, s, d = hidden_states.shape
    return hidden_states[:, :, None].expand(b, kvh, n_rep, s, d).reshape(b, kvh * n_rep, s, d)


class AquilaAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=False)
        self.rotary_emb = AquilaRotaryEmbedding(self.head_dim)

    def forward(self, hidden_states, attention_mask, position_ids, past_key_value=None, use_cache=False):
        bsz, q_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary_emb(value_states, position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        query_states = query_states * cos + rotate_half(query_states) * sin
        key_states = key_states * cos + rotate_half(key_states) * sin
        if past_key_value is not None:
            key_states = torch.cat([past_key_value[0], key_states], dim=2)
            value_states = torch.cat([past_key_value[1], value_states], dim=2)
        past_key_value = (key_states, value_states) if use_cache else None
        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(self.head_dim)
        attn_weights = attn_weights + attention_mask
        soft_dtype = torch.promote_types(query_states.dtype, torch.float32)
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=soft_dtype).to(query_states.dtype)
        attn_output = torch.matmul(attn_weights, value_states).transpose(1, 2).reshape(bsz, q_len, self.hidden_size)
        return self.o_proj(attn_output), past_key_value


class AquilaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class AquilaDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = AquilaAttention(config)
        self.mlp = AquilaMLP(config)
        self.input_layernorm = AquilaRMSNorm(config.hidden_size)
        self.post_attention_layernorm = AquilaRMSNorm(config.hidden_size)

    def forward(self, hidden_states, attention_mask, position_ids, past_key_value=None, use_cache=False):
        attn, present = self.self_attn(self.input_layernorm(hidden_states), attention_mask, position_ids,
                                       past_key_value, use_cache)
        hidden_states = hidden_states + attn
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states)), present


def _make_causal_mask(bsz, tgt_len, dtype, past_key_values_length=0):
    mask = torch.full((tgt_len, tgt_len), torch.finfo(dtype).min, dtype=dtype)
    mask_cond = torch.arange(mask.size(-1))
    mask.masked_fill_(mask_cond < (mask_cond + 1).view(mask.size(-1), 1), 0)
    mask = mask.to(dtype)
    if past_key_values_length > 0:
        mask = torch.cat([torch.zeros(tgt_len, past_key_values_length, dtype=dtype), mask], dim=-1)
    return mask[None, None, :, :].expand(bsz, 1, tgt_len, tgt_len + past_key_values_length)


class AquilaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([AquilaDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = AquilaRMSNorm(config.hidden_size)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        batch_size, seq_length = input_ids.shape
        past_key_values_length = 0 if past_key_values is None else past_key_values[0][0].shape[2]
        position_ids = torch.arange(0, seq_length, dtype=torch.long, device=input_ids.device)
        position_ids = position_ids.unsqueeze(0).view(-1, seq_length)
        inputs_embeds = self.embed_tokens(input_ids)
        attention_mask = _make_causal_mask(batch_size, seq_length, inputs_embeds.dtype, past_key_values_length)
        hidden_states = inputs_embeds
        next_decoder_cache = () if use_cache else None
        for idx, decoder_layer in enumerate(self.layers):
            past_key_value = past_key_values[idx] if past_key_values is not None else None
            hidden_states, present = decoder_layer(hidden_states, attention_mask, position_ids, past_key_value, use_cache)
            if use_cache:
                next_decoder_cache += (present,)
        return self.norm(hidden_states), next_decoder_cache


class AquilaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = AquilaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        hidden, cache = self.model(input_ids, past_key_values, use_cache)
        return SimpleNamespace(logits=self.lm_head(hidden), past_key_values=cache)


def make_model():
    torch.manual_seed(1110)
    config = SimpleNamespace(vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2)
    model = AquilaForCausalLM(config)
    g = torch.Generator().manual_seed(11101)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, AquilaRMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

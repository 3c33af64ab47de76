"""InternLM (first generation, remote code modeling_internlm.py) causal LM.

model.embed_tokens, model.layers.N (InternLMDecoderLayer: input_layernorm, self_attn,
post_attention_layernorm, mlp gate/up/down), model.norm, lm_head.  InternLMAttention: q_proj,
k_proj, v_proj, o_proj all with bias (config.bias = True), InternLMRotaryEmbedding with
cos_cached/sin_cached (1, 1, max, dim) sliced to kv_seq_len and gathered by position_ids,
rotate_half, legacy tuple cache (key, value) in (b, h, s, d), _prepare_decoder_attention_mask
(causal + past, finfo.min), explicit matmul / sqrt(hd), softmax upcast to float32 for half inputs.
Slip: the decoder-layer loop picks past_key_values[idx - 1] (a leftover of an enumerate that used
to start at 1), so layer 0 decodes against the last layer's cache, layer 1 against layer 0's ...
The full forward (no cache) is exact.
hf: model(ids, use_cache=True), then model(tok, past_key_values=out.past_key_values, use_cache=True).
"""

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["model.layers.0.self_attn", "model.layers.1.self_attn", "model.layers.2.self_attn"],
    "kind": "causal-multihead",
    "cache": "hf",
    "decode": {"mistake": "cache_other", "step": 0, "layer": "model.layers.0.self_attn"},
    "style": "InternLM v1 remote code: q/k/v/o with bias, cos_cached/sin_cached rotary gathered by position_ids, legacy "
    "(k, v) tuples, _prepare_decoder_attention_mask; slip: layer idx reads past_key_values[idx - 1] (another layer's cache)",
}


class InternLMConfig:
    vocab_size = 135
    hidden_size = 64
    intermediate_size = 160
    num_hidden_layers = 3
    num_attention_heads = 4
    max_position_embeddings = 64
    rms_norm_eps = 1e-6
    bias = True


class InternLMRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states


class InternLMRotaryEmbedding(nn.Module):
    def __init__(self, dim, max_position_embeddings=2048, base=10000):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).double() / dim))
        t = torch.arange(max_position_embeddings, dtype=torch.float64)
        freqs = torch.einsum("i,j->ij", t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos()[None, None, :, :].float(), persistent=False)
        self.register_buffer("sin_cached", emb.sin()[None, None, :, :].float(), persistent=False)

    def forward(self, x, seq_len):
        return (
            self.cos_cached[:, :, :seq_len, ...].to(dtype=x.dtype),
            self.sin_cached[:, :, :seq_len, ...].to(dtype=x.dtype),
        )


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids):
    cos = cos.squeeze(1).squeeze(0)
    sin = sin.squeeze(1).squeeze(0)
    cos = cos[position_ids].unsqueeze(1)
    sin = sin[position_ids].unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class InternLMAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=config.bias)
        self.k_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=config.bias)
        self.v_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=config.bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=config.bias)
        self.rotary_emb = InternLMRotaryEmbedding(
            self.head_dim, max_position_embeddings=config.max_position_embeddings
        )

    def forward(
        self,
        hidden_states,
        attention_mask=None,
        position_ids=None,
        past_key_value=None,
        use_cache=False,
    ):
        bsz, q_len, _ = hidden_states.size()
        query_states = (
            self.q_proj(hidden_states)
            .view(bsz, q_len, self.num_heads, self.head_dim)
            .transpose(1, 2)
        )
        key_states = (
            self.k_proj(hidden_states)
            .view(bsz, q_len, self.num_heads, self.head_dim)
            .transpose(1, 2)
        )
        value_states = (
            self.v_proj(hidden_states)
            .view(bsz, q_len, self.num_heads, self.head_dim)
            .transpose(1, 2)
        )
        kv_seq_len = key_states.shape[-2]
        if past_key_value is not None:
            kv_seq_len += past_key_value[0].shape[-2]
        cos, sin = self.rotary_emb(value_states, seq_len=kv_seq_len)
        query_states, key_states = apply_rotary_pos_emb(
            query_states, key_states, cos, sin, position_ids
        )
        if past_key_value is not None:
            key_states = torch.cat([past_key_value[0], key_states], dim=2)
            value_states = torch.cat([past_key_value[1], value_states], dim=2)
        past_key_value = (key_states, value_states) if use_cache else None
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(
            self.head_dim
        )
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
            attn_weights = torch.max(
                attn_weights,
                torch.tensor(torch.finfo(attn_weights.dtype).min, device=attn_weights.device),
            )
        up = (
            torch.float32
            if attn_weights.dtype in (torch.float16, torch.bfloat16)
            else attn_weights.dtype
        )
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=up).to(query_states.dtype)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, self.hidden_size)
        return self.o_proj(attn_output), None, past_key_value


class InternLMMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class InternLMDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = InternLMAttention(config)
        self.mlp = InternLMMLP(config)
        self.input_layernorm = InternLMRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = InternLMRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states,
        attention_mask=None,
        position_ids=None,
        past_key_value=None,
        use_cache=False,
    ):
        residual = hidden_states
        hidden_states, _, present = self.self_attn(
            hidden_states=self.input_layernorm(hidden_states),
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_value=past_key_value,
            use_cache=use_cache,
        )
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = residual + self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states, present


def _make_causal_mask(bsz, tgt_len, dtype, device, past_key_values_length=0):
    mask = torch.full(
        (tgt_len, tgt_len), torch.tensor(torch.finfo(dtype).min, device=device), device=device
    )
    mask_cond = torch.arange(mask.size(-1), device=device)
    mask.masked_fill_(mask_cond < (mask_cond + 1).view(mask.size(-1), 1), 0)
    mask = mask.to(dtype)
    if past_key_values_length > 0:
        mask = torch.cat(
            [torch.zeros(tgt_len, past_key_values_length, dtype=dtype, device=device), mask], dim=-1
        )
    return mask[None, None, :, :].expand(bsz, 1, tgt_len, tgt_len + past_key_values_length)


class InternLMModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [InternLMDecoderLayer(config) for _ in range(config.num_hidden_layers)]
        )
        self.norm = InternLMRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        batch_size, seq_length = input_ids.shape
        past_key_values_length = (
            past_key_values[0][0].shape[2] if past_key_values is not None else 0
        )
        position_ids = (
            torch.arange(
                past_key_values_length,
                seq_length + past_key_values_length,
                dtype=torch.long,
                device=input_ids.device,
            )
            .unsqueeze(0)
            .view(-1, seq_length)
        )
        hidden_states = self.embed_tokens(input_ids)
        attention_mask = _make_causal_mask(
            batch_size, seq_length, hidden_states.dtype, input_ids.device, past_key_values_length
        )
        next_decoder_cache = () if use_cache else None
        for idx, decoder_layer in enumerate(self.layers):
            past_key_value = past_key_values[idx - 1] if past_key_values is not None else None
            hidden_states, present = decoder_layer(
                hidden_states,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_value=past_key_value,
                use_cache=use_cache,
            )
            if use_cache:
                next_decoder_cache += (present,)
        return self.norm(hidden_states), next_decoder_cache


@dataclass
class CausalLMOutputWithPast:
    logits: torch.Tensor
    past_key_values: Optional[Tuple] = None


class InternLMForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = InternLMModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        hidden, cache = self.model(input_ids, past_key_values=past_key_values, use_cache=use_cache)
        return CausalLMOutputWithPast(logits=self.lm_head(hidden), past_key_values=cache)


def make_model():
    torch.manual_seed(714)
    model = InternLMForCausalLM(InternLMConfig())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Linear):
                m.weight.normal_(0.0, 0.1)
                if m.bias is not None:
                    m.bias.normal_(0.0, 0.05)
            elif isinstance(m, nn.Embedding):
                m.weight.normal_(0.0, 0.5)
            elif isinstance(m, InternLMRMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn_like(m.weight))
    return model.eval()

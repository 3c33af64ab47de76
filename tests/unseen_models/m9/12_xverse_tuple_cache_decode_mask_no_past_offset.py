"""XVERSE (xverse-ai XVERSE-7B/13B modeling_xverse.py) decoder (small, random weights).

XverseForCausalLM: model (XverseModel: embed_tokens, layers.N, norm) and lm_head.
XverseDecoderLayer: input_layernorm -> self_attn, post_attention_layernorm -> mlp (SiLU gate/up/down).
XverseAttention: q/k/v/o without bias, MHA 4 heads, rotary (halves, rotate_half) from
cos_cached/sin_cached indexed by position_ids, base 1e4, matmul / sqrt(head_dim), an additive
(bsz, 1, tgt, src) mask from `_prepare_decoder_attention_mask`, softmax upcast to at least float32.
Cache: hf tuples of per-layer `(k, v)` in (b, h, s, d) concatenated on dim 2:
`out = model(ids, use_cache=True)`, then `model(tok, past_key_values=out.past_key_values, use_cache=True)`;
logits in `out.logits`.
Slip: `_make_causal_mask` builds the (tgt, past + tgt) mask in one go as
`torch.full(...).triu(1)` without shifting the diagonal by the past length, so with a cache a decoded
token (row 0) sees only key 0, the first prompt token: neither the other cached keys nor itself.
With no cache (full forward, prompt pass) the mask is the ordinary causal one.
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
        "mistake": "cache_mask",
        "step": 0,
        "layer": "model.layers.0.self_attn",
    },
    "style": "modeling_xverse.py: cos_cached/sin_cached by position_ids, legacy (k, v) tuples (b, h, s, d), "
    "_prepare_decoder_attention_mask; the causal mask over (tgt, past + tgt) is triu(1) with no past offset",
}


def _make_causal_mask(input_ids_shape, dtype, device, past_key_values_length=0):
    bsz, tgt_len = input_ids_shape
    src_len = tgt_len + past_key_values_length
    mask = torch.full((tgt_len, src_len), torch.finfo(dtype).min, dtype=dtype, device=device).triu(1)
    return mask[None, None, :, :].expand(bsz, 1, tgt_len, src_len)


class XverseRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class XverseRotaryEmbedding(nn.Module):
    def __init__(self, dim, max_position_embeddings=128, base=10000):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        t = torch.arange(max_position_embeddings, dtype=self.inv_freq.dtype)
        freqs = torch.einsum("i,j->ij", t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def forward(self, x, position_ids):
        return self.cos_cached[position_ids].to(x.dtype), self.sin_cached[position_ids].to(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class XverseAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.q_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=False)
        self.k_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=False)
        self.v_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=False)
        self.o_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=False)
        self.rotary_emb = XverseRotaryEmbedding(self.head_dim, config.max_position_embeddings)

    def forward(self, hidden_states, attention_mask, position_ids, past_key_value=None, use_cache=False):
        bsz, q_len, _ = hidden_states.size()
        q = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary_emb(v, position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if past_key_value is not None:
            k = torch.cat([past_key_value[0], k], dim=2)
            v = torch.cat([past_key_value[1], v], dim=2)
        past_key_value = (k, v) if use_cache else None
        attn_weights = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.head_dim)
        attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.promote_types(q.dtype, torch.float32)).to(q.dtype)
        attn_output = torch.matmul(attn_weights, v).transpose(1, 2).reshape(bsz, q_len, self.hidden_size)
        return self.o_proj(attn_output), None, past_key_value


class XverseMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class XverseDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = XverseAttention(config)
        self.mlp = XverseMLP(config)
        self.input_layernorm = XverseRMSNorm(config.hidden_size)
        self.post_attention_layernorm = XverseRMSNorm(config.hidden_size)

    def forward(self, hidden_states, attention_mask, position_ids, past_key_value=None, use_cache=False):
        residual = hidden_states
        hidden_states, _, present = self.self_attn(
            hidden_states=self.input_layernorm(hidden_states), attention_mask=attention_mask,
            position_ids=position_ids, past_key_value=past_key_value, use_cache=use_cache)
        hidden_states = residual + hidden_states
        hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states, present


class XverseModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([XverseDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = XverseRMSNorm(config.hidden_size)

    def _prepare_decoder_attention_mask(self, input_shape, inputs_embeds, past_key_values_length):
        return _make_causal_mask(input_shape, inputs_embeds.dtype, inputs_embeds.device,
                                 past_key_values_length=past_key_values_length)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        batch_size, seq_length = input_ids.shape
        past_key_values_length = past_key_values[0][0].shape[2] if past_key_values is not None else 0
        position_ids = torch.arange(past_key_values_length, seq_length + past_key_values_length,
                                    dtype=torch.long, device=input_ids.device).unsqueeze(0)
        inputs_embeds = self.embed_tokens(input_ids)
        attention_mask = self._prepare_decoder_attention_mask((batch_size, seq_length), inputs_embeds,
                                                              past_key_values_length)
        hidden_states = inputs_embeds
        next_decoder_cache = () if use_cache else None
        for idx, decoder_layer in enumerate(self.layers):
            past = past_key_values[idx] if past_key_values is not None else None
            hidden_states, present = decoder_layer(hidden_states, attention_mask, position_ids, past, use_cache)
            if use_cache:
                next_decoder_cache += (present,)
        return self.norm(hidden_states), next_decoder_cache


class XverseForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = XverseModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        h, cache = self.model(input_ids, past_key_values=past_key_values, use_cache=use_cache)
        return SimpleNamespace(logits=self.lm_head(h), past_key_values=cache)


def make_model():
    torch.manual_seed(912)
    config = SimpleNamespace(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                             num_attention_heads=4, max_position_embeddings=128)
    model = XverseForCausalLM(config)
    g = torch.Generator().manual_seed(9121)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, XverseRMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

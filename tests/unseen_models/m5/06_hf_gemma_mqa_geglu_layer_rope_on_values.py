"""Gemma (first generation, 2B-style) in the shape of transformers' modeling_gemma.py (written from
memory, in my own words): embeddings multiplied by normalizer = sqrt(hidden_size) in the hidden
dtype, GemmaRMSNorm with (1 + weight), multi-query attention (4 query heads, 1 kv head) with
head_dim 24 so heads x head_dim (96) differs from hidden_size (64), rotate_half rotary base 10000,
GeGLU MLP (gelu tanh), tied lm_head, 3 layers.  `_attn_implementation_per_layer` picks the
attention class per layer; layer 2 runs "GemmaFusedRopeAttention", which rotates q, k *and* v with
one generator expression.

Cache (hf): out = model(prompt, use_cache=True); out = model(tok, past_key_values=out.past_key_values,
use_cache=True).  past_key_values is a tuple per layer of (key, value), (batch, 1, seq, 24), keys
stored rotated (and, in layer 2, values stored rotated too: the slip is consistent between the full
forward and decoding).

Slip: `model.layers.2.self_attn` applies the rotary embedding to the values (stage `values`,
`rope_on_values`).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["model.layers.0.self_attn", "model.layers.1.self_attn", "model.layers.2.self_attn"],
    "kind": "causal-multihead",
    "cache": "hf",
    "layer": "model.layers.2.self_attn",
    "stage": "values",
    "mistake": "rope_on_values",
    "style": "modeling_gemma.py: sqrt(d) embedding scale, (1+w) RMSNorm, MQA 4/1, head_dim 24 (96 != 64), GeGLU, "
    "tied head; slip: layer 2's fused-rope class rotates the values too",
}


class GemmaConfig:
    vocab_size = 190
    hidden_size = 64
    intermediate_size = 128
    num_hidden_layers = 3
    num_attention_heads = 4
    num_key_value_heads = 1
    head_dim = 24
    rope_theta = 10000.0
    rms_norm_eps = 1e-6
    _attn_implementation_per_layer = ["eager", "eager", "fused_rope"]


class GemmaRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        output = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return output * (1.0 + self.weight)


class GemmaRotaryEmbedding(nn.Module):
    def __init__(self, dim, base):
        super().__init__()
        self.register_buffer(
            "inv_freq",
            1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)),
            persistent=False,
        )

    def forward(self, x, position_ids):
        freqs = position_ids[:, :, None].double() * self.inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x, cos, sin):
    return (x * cos.unsqueeze(1)) + (rotate_half(x) * sin.unsqueeze(1))


class GemmaAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.head_dim = config.head_dim
        self.scaling = self.head_dim**-0.5
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)

    def project(self, hidden_states):
        bsz, q_len, _ = hidden_states.shape
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
        return q, k, v

    def rope(self, q, k, v, cos, sin):
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_value=None):
        bsz, q_len, _ = hidden_states.shape
        cos, sin = position_embeddings
        q, k, v = self.rope(*self.project(hidden_states), cos, sin)
        if past_key_value is not None:
            k = torch.cat([past_key_value[0], k], dim=2)
            v = torch.cat([past_key_value[1], v], dim=2)
        present = (k, v)
        k_rep = k.repeat_interleave(self.num_key_value_groups, dim=1)
        v_rep = v.repeat_interleave(self.num_key_value_groups, dim=1)
        attn_weights = torch.matmul(q, k_rep.transpose(2, 3)) * self.scaling
        attn_weights = attn_weights + attention_mask
        attn_weights = (
            F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(q.dtype)
            if q.dtype != torch.float64
            else F.softmax(attn_weights, dim=-1)
        )
        attn_output = torch.matmul(attn_weights, v_rep)
        attn_output = attn_output.transpose(1, 2).contiguous().view(bsz, q_len, -1)
        return self.o_proj(attn_output), present


class GemmaFusedRopeAttention(GemmaAttention):
    """Port of a fused-kernel path: the kernel takes a tuple of tensors to rotate."""

    def rope(self, q, k, v, cos, sin):
        q, k, v = (apply_rotary(t, cos, sin) for t in (q, k, v))
        return q, k, v


GEMMA_ATTENTION_CLASSES = {"eager": GemmaAttention, "fused_rope": GemmaFusedRopeAttention}


class GemmaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        impl = config._attn_implementation_per_layer[layer_idx]
        self.self_attn = GEMMA_ATTENTION_CLASSES[impl](config, layer_idx)
        self.mlp = GemmaMLP(config)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_value):
        residual = hidden_states
        h, present = self.self_attn(
            self.input_layernorm(hidden_states), position_embeddings, attention_mask, past_key_value
        )
        hidden_states = residual + h
        hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states, present


class GemmaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [GemmaDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = GemmaRotaryEmbedding(config.head_dim, config.rope_theta)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        bsz, seq_len = input_ids.shape
        past_seen = past_key_values[0][0].shape[-2] if past_key_values is not None else 0
        inputs_embeds = self.embed_tokens(input_ids)
        cache_position = torch.arange(past_seen, past_seen + seq_len)
        position_ids = cache_position.unsqueeze(0).expand(bsz, -1)
        dtype = inputs_embeds.dtype
        target = past_seen + seq_len
        causal_mask = torch.full((seq_len, target), torch.finfo(dtype).min, dtype=dtype)
        causal_mask = causal_mask * (torch.arange(target)[None, :] > cache_position[:, None])
        causal_mask = causal_mask[None, None]
        normalizer = torch.tensor(self.config.hidden_size**0.5, dtype=dtype)
        hidden_states = inputs_embeds * normalizer
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        presents = ()
        for i, layer in enumerate(self.layers):
            past = past_key_values[i] if past_key_values is not None else None
            hidden_states, present = layer(hidden_states, position_embeddings, causal_mask, past)
            presents = presents + (present,)
        return self.norm(hidden_states), (presents if use_cache else None)


class CausalLMOutputWithPast:
    def __init__(self, logits, past_key_values):
        self.logits = logits
        self.past_key_values = past_key_values


class GemmaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = GemmaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        hidden_states, pkv = self.model(input_ids, past_key_values, use_cache)
        return CausalLMOutputWithPast(self.lm_head(hidden_states), pkv)


def make_model():
    torch.manual_seed(5606)
    model = GemmaForCausalLM(GemmaConfig())
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(0.15)
        for m in model.modules():
            if isinstance(m, GemmaRMSNorm):
                m.weight.copy_(0.3 * torch.randn_like(m.weight))
    return model.eval()

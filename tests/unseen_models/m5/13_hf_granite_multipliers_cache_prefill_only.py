"""IBM Granite (3.x dense) in the shape of transformers' modeling_granite.py (written from memory, in
my own words): Llama layout with Granite's four multipliers -- embedding_multiplier (scales the
token embeddings), attention_multiplier (used as the attention scale; this config sets it to
1/sqrt(head_dim) = 0.25), residual_multiplier (scales each sublayer output before the residual
add) and logits_scaling (logits divided by it).  Multi-query attention (4 heads, 1 kv head of 16),
rotate_half rotary base 10000, SDPA with is_causal for multi-token calls and no mask for one-token
calls (transformers' sdpa path), RMSNorm, SwiGLU MLP, 3 layers.

Cache (hf): out = model(prompt, use_cache=True); out = model(tok, past_key_values=out.past_key_values,
use_cache=True).  With use_cache=True the model creates a GraniteCache (defined below).  Positions
come from the cache's `_seen_tokens` counter, which the first layer's update advances.

Slip (decoding only): GraniteCache.update only writes the concatenation back when it holds more than
one new token ("prefill"); a one-token update returns past + new for the current step but does not
store it.  Step 0 is exact (it sees the prompt and itself); at step 1 the step-0 token is missing
from every layer's cache.  Decode: `cache_stale`, step 1, `model.layers.0.self_attn`.
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
    "decode": {"mistake": "cache_stale", "step": 1, "layer": "model.layers.0.self_attn"},
    "style": "modeling_granite.py: embedding/residual/attention multipliers, logits_scaling, MQA 4/1, SDPA is_causal; "
    "slip: cache only stores multi-token updates, so decoded tokens are never kept",
}


class GraniteConfig:
    vocab_size = 140
    hidden_size = 64
    intermediate_size = 112
    num_hidden_layers = 3
    num_attention_heads = 4
    num_key_value_heads = 1
    rope_theta = 10000.0
    rms_norm_eps = 1e-6
    embedding_multiplier = 2.0
    attention_multiplier = 0.25
    residual_multiplier = 0.6
    logits_scaling = 2.0


class GraniteCache:
    def __init__(self):
        self.key_cache = []
        self.value_cache = []
        self._seen_tokens = 0

    def update(self, key_states, value_states, layer_idx):
        if layer_idx == 0:
            self._seen_tokens += key_states.shape[-2]
        if len(self.key_cache) <= layer_idx:
            self.key_cache.append(key_states)
            self.value_cache.append(value_states)
            return key_states, value_states
        keys = torch.cat([self.key_cache[layer_idx], key_states], dim=-2)
        values = torch.cat([self.value_cache[layer_idx], value_states], dim=-2)
        if key_states.shape[-2] > 1:
            self.key_cache[layer_idx] = keys
            self.value_cache[layer_idx] = values
        return keys, values

    def get_seq_length(self, layer_idx=0):
        return self._seen_tokens


class GraniteRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class GraniteRotaryEmbedding(nn.Module):
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


class GraniteAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.scaling = config.attention_multiplier
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(
            config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False
        )
        self.v_proj = nn.Linear(
            config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False
        )
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states, position_embeddings, past_key_value=None):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        query_states = query_states * cos + rotate_half(query_states) * sin
        key_states = key_states * cos + rotate_half(key_states) * sin
        if past_key_value is not None:
            key_states, value_states = past_key_value.update(
                key_states, value_states, self.layer_idx
            )
        q_len = query_states.shape[2]
        attn_output = F.scaled_dot_product_attention(
            query_states,
            key_states,
            value_states,
            is_causal=q_len > 1,
            scale=self.scaling,
            enable_gqa=True,
        )
        attn_output = attn_output.transpose(1, 2).reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), None


class GraniteMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GraniteDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = GraniteAttention(config, layer_idx)
        self.mlp = GraniteMLP(config)
        self.input_layernorm = GraniteRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = GraniteRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.residual_multiplier = config.residual_multiplier

    def forward(self, hidden_states, position_embeddings, past_key_value):
        residual = hidden_states
        hidden_states, _ = self.self_attn(
            self.input_layernorm(hidden_states), position_embeddings, past_key_value
        )
        hidden_states = residual + hidden_states * self.residual_multiplier
        residual = hidden_states
        hidden_states = self.mlp(self.post_attention_layernorm(hidden_states))
        return residual + hidden_states * self.residual_multiplier


class GraniteModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [GraniteDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = GraniteRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = GraniteRotaryEmbedding(
            config.hidden_size // config.num_attention_heads, config.rope_theta
        )
        self.embedding_multiplier = config.embedding_multiplier

    def forward(self, input_ids, past_key_values=None):
        bsz, seq_len = input_ids.shape
        inputs_embeds = self.embed_tokens(input_ids) * self.embedding_multiplier
        past_seen_tokens = past_key_values.get_seq_length() if past_key_values is not None else 0
        cache_position = torch.arange(past_seen_tokens, past_seen_tokens + seq_len)
        position_ids = cache_position.unsqueeze(0)
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        hidden_states = inputs_embeds
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(hidden_states, position_embeddings, past_key_values)
        return self.norm(hidden_states)


class CausalLMOutputWithPast:
    def __init__(self, logits, past_key_values):
        self.logits = logits
        self.past_key_values = past_key_values


class GraniteForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = GraniteModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        if use_cache and past_key_values is None:
            past_key_values = GraniteCache()
        hidden_states = self.model(input_ids, past_key_values if use_cache else None)
        logits = self.lm_head(hidden_states) / self.config.logits_scaling
        return CausalLMOutputWithPast(logits, past_key_values if use_cache else None)


def make_model():
    torch.manual_seed(6313)
    model = GraniteForCausalLM(GraniteConfig())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, GraniteRMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn_like(m.weight))
    return model.eval()

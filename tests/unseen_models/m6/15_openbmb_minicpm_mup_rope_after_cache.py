"""MiniCPM (openbmb MiniCPM-2B `modeling_minicpm.py`, remote code; written from memory, in my own
words): Llama skeleton with MiniCPM's muP-style scalings: embeddings × `scale_emb` (12), each
residual branch × `scale_depth / sqrt(num_hidden_layers)` (1.4 / sqrt(3)), hidden states divided by
`hidden_size / dim_model_base` (64 / 32) before the tied lm_head.  `model.layers.N.self_attn` with
q/k/v/o_proj (no bias), GQA 4/2 (head_dim 16), rotate_half rotary base 10000 indexed by
position_ids, eager attention with an additive finfo.min mask built for (q_len, past + q_len),
RMSNorm, SwiGLU MLP.  3 layers, vocab 150.

Cache (hf): `out = model(ids, use_cache=True)` creates a `MiniCPMCache` (per-layer key/value lists,
(b, kv, s, d), `update()` concatenates on dim −2); continue with `model(tok,
past_key_values=out.past_key_values, use_cache=True)`.  Returns an object with `.logits` and
`.past_key_values`.

Decode slip: this port calls `past_key_value.update()` *before* `apply_rotary_pos_emb`, then rotates
the keys it got back with the current call's cos/sin.  With no cache, or on the prompt, every key is
rotated at its own position (exact).  On a decode step the cache holds unrotated keys and the whole
concatenation is rotated with the new token's single angle (broadcast over the sequence), so every
cached key lands at the new token's position; the new token itself is placed right.
decode `cache_other` (cached keys stored unrotated / re-rotated), step 0, `model.layers.0.self_attn`.
"""

import math

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
    "style": "MiniCPM modeling_minicpm.py: scale_emb, scale_depth/sqrt(L) residuals, dim_model_base logit scaling, GQA 4/2, "
    "MiniCPMCache; slip: cache.update before the rotary, the returned keys all rotated with the new token's angle",
}


class MiniCPMConfig:
    vocab_size = 150
    hidden_size = 64
    intermediate_size = 128
    num_hidden_layers = 3
    num_attention_heads = 4
    num_key_value_heads = 2
    rope_theta = 10000.0
    rms_norm_eps = 1e-6
    scale_emb = 12.0
    scale_depth = 1.4
    dim_model_base = 32


class MiniCPMCache:
    def __init__(self):
        self.key_cache = []
        self.value_cache = []

    def get_seq_length(self, layer_idx=0):
        return 0 if len(self.key_cache) <= layer_idx else self.key_cache[layer_idx].shape[-2]

    def update(self, key_states, value_states, layer_idx):
        if len(self.key_cache) <= layer_idx:
            self.key_cache.append(key_states)
            self.value_cache.append(value_states)
        else:
            self.key_cache[layer_idx] = torch.cat([self.key_cache[layer_idx], key_states], dim=-2)
            self.value_cache[layer_idx] = torch.cat(
                [self.value_cache[layer_idx], value_states], dim=-2
            )
        return self.key_cache[layer_idx], self.value_cache[layer_idx]


class CausalLMOutputWithPast:
    def __init__(self, logits, past_key_values):
        self.logits = logits
        self.past_key_values = past_key_values


def rms_layernorm(hidden, weight, eps):
    variance = hidden.pow(2).mean(dim=-1, keepdim=True)
    return hidden * torch.rsqrt(variance + eps) * weight


class MiniCPMRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        return rms_layernorm(hidden_states, self.weight, self.variance_epsilon)


class MiniCPMRotaryEmbedding(nn.Module):
    def __init__(self, dim, max_position_embeddings=128, base=10000.0):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        t = torch.arange(max_position_embeddings, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def forward(self, x, seq_len):
        return self.cos_cached[:seq_len].to(x.dtype), self.sin_cached[:seq_len].to(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids, unsqueeze_dim=1):
    cos = cos[position_ids].unsqueeze(unsqueeze_dim)
    sin = sin[position_ids].unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def repeat_kv(hidden_states, n_rep):
    b, kvh, s, d = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    return hidden_states[:, :, None].expand(b, kvh, n_rep, s, d).reshape(b, kvh * n_rep, s, d)


class MiniCPMAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(
            self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False
        )
        self.v_proj = nn.Linear(
            self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False
        )
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=False)
        self.rotary_emb = MiniCPMRotaryEmbedding(self.head_dim, base=config.rope_theta)

    def forward(self, hidden_states, attention_mask, position_ids, past_key_value=None):
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

        kv_seq_len = key_states.shape[-2]
        if past_key_value is not None:
            kv_seq_len += past_key_value.get_seq_length(self.layer_idx)
            key_states, value_states = past_key_value.update(
                key_states, value_states, self.layer_idx
            )
        cos, sin = self.rotary_emb(value_states, seq_len=kv_seq_len)
        query_states, key_states = apply_rotary_pos_emb(
            query_states, key_states, cos, sin, position_ids
        )

        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(
            self.head_dim
        )
        attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).contiguous().reshape(bsz, q_len, self.hidden_size)
        return self.o_proj(attn_output)


class MiniCPMMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MiniCPMDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = MiniCPMAttention(config, layer_idx)
        self.mlp = MiniCPMMLP(config)
        self.input_layernorm = MiniCPMRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = MiniCPMRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.scale_depth = config.scale_depth
        self.num_hidden_layers = config.num_hidden_layers

    def forward(self, hidden_states, attention_mask, position_ids, past_key_value=None):
        residual = hidden_states
        hidden_states = self.self_attn(
            self.input_layernorm(hidden_states), attention_mask, position_ids, past_key_value
        )
        hidden_states = residual + hidden_states * (
            self.scale_depth / math.sqrt(self.num_hidden_layers)
        )
        residual = hidden_states
        hidden_states = self.mlp(self.post_attention_layernorm(hidden_states))
        return residual + hidden_states * (self.scale_depth / math.sqrt(self.num_hidden_layers))


class MiniCPMModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [MiniCPMDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = MiniCPMRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        batch_size, seq_length = input_ids.shape
        if use_cache and past_key_values is None:
            past_key_values = MiniCPMCache()
        past = (
            past_key_values.get_seq_length() if (use_cache and past_key_values is not None) else 0
        )
        position_ids = torch.arange(past, past + seq_length, dtype=torch.long)[None].expand(
            batch_size, -1
        )
        inputs_embeds = self.embed_tokens(input_ids) * self.config.scale_emb
        dtype = inputs_embeds.dtype
        mask = torch.full((seq_length, seq_length), torch.finfo(dtype).min, dtype=dtype).triu(1)
        mask = torch.cat([torch.zeros(seq_length, past, dtype=dtype), mask], dim=-1)[None, None]
        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(
                hidden_states, mask, position_ids, past_key_values if use_cache else None
            )
        return self.norm(hidden_states), past_key_values


class MiniCPMForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = MiniCPMModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        hidden_states, past = self.model(
            input_ids, past_key_values=past_key_values, use_cache=use_cache
        )
        logits = self.lm_head(
            hidden_states / (self.config.hidden_size / self.config.dim_model_base)
        )
        return CausalLMOutputWithPast(logits, past if use_cache else None)


def make_model():
    torch.manual_seed(6115)
    model = MiniCPMForCausalLM(MiniCPMConfig())
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 0.1)
        for m in model.modules():
            if isinstance(m, MiniCPMRMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn_like(m.weight))
    return model.eval()

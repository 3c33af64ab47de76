"""transformers modeling_vaultgemma.py (VaultGemma, Gemma-2 lineage without the sandwich norms).

VaultGemmaForCausalLM: model (VaultGemmaModel: embed_tokens, layers.N, norm, rotary_emb) and lm_head
tied to the embeddings.  The embeddings are multiplied by `normalizer = sqrt(hidden_size)` (cast to the
hidden dtype); VaultGemmaRMSNorm computes in float32 (float64 kept) and scales by (1 + weight).
VaultGemmaDecoderLayer: input_layernorm -> self_attn -> + residual -> pre_feedforward_layernorm -> mlp
(gate_proj/up_proj/down_proj, gelu tanh) -> + residual.  VaultGemmaAttention: q/k/v/o without bias,
GQA 4/2 (head 16) with repeat_kv, rotate_half rotary base 1e4, `scaling = query_pre_attn_scalar**-0.5`
with query_pre_attn_scalar = head_dim, `attn_logit_softcapping` None, `sliding_window` set on the
sliding layers.  `config.layer_types` = sliding, full, sliding with `sliding_window` 4 (a query sees
itself and the 3 keys before it); the model builds both masks from `cache_position` and hands each layer
the one of its type.  Final logits soft-capped at 30 (outside attention).
Cache: hf with a cache object: `out = model(ids, use_cache=True)`, then
`model(tok, past_key_values=out.past_key_values, use_cache=True)`; `VaultGemmaCache.update(k, v, layer_idx)`
grows (b, kv, s, d) entries on dim -2; logits in `out.logits`.  Correct.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": [
        "model.layers.0.self_attn",
        "model.layers.1.self_attn",
        "model.layers.2.self_attn",
    ],
    "kind": "causal-multihead",
    "cache": "hf",
    "style": "modeling_vaultgemma.py: normalizer sqrt(d), (1 + w) RMSNorm, no post-norms, layer_types sliding/full/"
    "sliding (window 4), query_pre_attn_scalar = head_dim, GQA 4/2 repeat_kv, rotate_half base 1e4, masks from "
    "cache_position, cache object with update(), final logit softcap",
}


class VaultGemmaRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        up = x.float() if x.dtype != torch.float64 else x
        output = self._norm(up)
        output = output * (1.0 + self.weight.to(output.dtype))
        return output.type_as(x)


class VaultGemmaCache:
    def __init__(self):
        self.key_cache = []
        self.value_cache = []

    def get_seq_length(self, layer_idx=0):
        if len(self.key_cache) <= layer_idx:
            return 0
        return self.key_cache[layer_idx].shape[-2]

    def update(self, key_states, value_states, layer_idx):
        if len(self.key_cache) <= layer_idx:
            self.key_cache.append(key_states)
            self.value_cache.append(value_states)
        else:
            self.key_cache[layer_idx] = torch.cat([self.key_cache[layer_idx], key_states], dim=-2)
            self.value_cache[layer_idx] = torch.cat([self.value_cache[layer_idx], value_states], dim=-2)
        return self.key_cache[layer_idx], self.value_cache[layer_idx]


class VaultGemmaRotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        dim = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x, position_ids):
        inv = self.inv_freq.double()
        freqs = position_ids[:, :, None].double() * inv[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


def eager_attention_forward(module, query, key, value, attention_mask, scaling, softcap=None):
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if softcap is not None:
        attn_weights = torch.tanh(attn_weights / softcap) * softcap
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask[:, :, :, : key_states.shape[-2]]
    attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32 if query.dtype != torch.float64 else torch.float64).to(query.dtype)
    attn_output = torch.matmul(attn_weights, value_states)
    return attn_output.transpose(1, 2).contiguous(), attn_weights


class VaultGemmaAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.layer_type = config.layer_types[layer_idx]
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = config.query_pre_attn_scalar**-0.5
        self.attn_logit_softcapping = config.attn_logit_softcapping
        self.sliding_window = config.sliding_window if self.layer_type == "sliding_attention" else None
        self.is_causal = True
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        if past_key_values is not None:
            key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)
        attn_output, attn_weights = eager_attention_forward(
            self, query_states, key_states, value_states, attention_mask,
            scaling=self.scaling, softcap=self.attn_logit_softcapping,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights


class VaultGemmaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class VaultGemmaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.attention_type = config.layer_types[layer_idx]
        self.self_attn = VaultGemmaAttention(config, layer_idx)
        self.mlp = VaultGemmaMLP(config)
        self.input_layernorm = VaultGemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.pre_feedforward_layernorm = VaultGemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(hidden_states, position_embeddings, attention_mask, past_key_values)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.mlp(self.pre_feedforward_layernorm(hidden_states))
        return residual + hidden_states


def _build_mask(cache_position, kv_length, dtype, sliding_window=None):
    q_idx = cache_position[:, None]
    kv_idx = torch.arange(kv_length, device=cache_position.device)[None, :]
    allowed = kv_idx <= q_idx
    if sliding_window is not None:
        allowed = allowed & (kv_idx > q_idx - sliding_window)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=cache_position.device)
    mask = mask.masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


class VaultGemmaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList([VaultGemmaDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = VaultGemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = VaultGemmaRotaryEmbedding(config)

    def forward(self, input_ids, past_key_values=None, use_cache=False, cache_position=None, position_ids=None):
        inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and past_key_values is None:
            past_key_values = VaultGemmaCache()
        past_seen_tokens = past_key_values.get_seq_length() if past_key_values is not None else 0
        if cache_position is None:
            cache_position = torch.arange(
                past_seen_tokens, past_seen_tokens + inputs_embeds.shape[1], device=inputs_embeds.device
            )
        if position_ids is None:
            position_ids = cache_position.unsqueeze(0).expand(inputs_embeds.shape[0], -1)
        kv_length = past_seen_tokens + inputs_embeds.shape[1]
        dtype = inputs_embeds.dtype
        causal_mask_mapping = {
            "full_attention": _build_mask(cache_position, kv_length, dtype),
            "sliding_attention": _build_mask(cache_position, kv_length, dtype, self.config.sliding_window),
        }
        hidden_states = inputs_embeds
        normalizer = torch.tensor(self.config.hidden_size**0.5, dtype=hidden_states.dtype)
        hidden_states = hidden_states * normalizer
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(
                hidden_states, position_embeddings,
                causal_mask_mapping[decoder_layer.attention_type], past_key_values,
            )
        return self.norm(hidden_states), past_key_values


class VaultGemmaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = VaultGemmaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        hidden_states, cache = self.model(input_ids, past_key_values=past_key_values, use_cache=use_cache)
        logits = self.lm_head(hidden_states)
        if self.config.final_logit_softcapping is not None:
            logits = torch.tanh(logits / self.config.final_logit_softcapping) * self.config.final_logit_softcapping
        return SimpleNamespace(logits=logits, past_key_values=cache if use_cache else None)


def make_model():
    torch.manual_seed(1803)
    config = SimpleNamespace(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
        rms_norm_eps=1e-6, rope_theta=10000.0, pad_token_id=0, sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        attn_logit_softcapping=None, final_logit_softcapping=30.0,
    )
    model = VaultGemmaForCausalLM(config)
    g = torch.Generator().manual_seed(18031)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 0.2, generator=g)
        for m in model.modules():
            if isinstance(m, VaultGemmaRMSNorm):
                m.weight.copy_(0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

"""Llama 4 text model (transformers modeling_llama4.py, Llama4ForCausalLM) -- the transformers code
base, not Meta's llama-models reference.

model (Llama4TextModel: embed_tokens, layers.N = Llama4TextDecoderLayer (input_layernorm, self_attn,
post_attention_layernorm, feed_forward), norm, rotary_emb) and lm_head.  `no_rope_layers` = [1, 1, 1, 0]:
layers 0-2 use rope ("chunked_attention" type; attention_chunk_size 8192, far above any length here, so
their mask is the plain causal one), layer 3 is a NoPE "full_attention" layer with
attn_temperature_tuning (floor_scale 8192: the factor is exactly 1 for these positions).
Llama4TextRotaryEmbedding returns complex freqs_cis (base 5e5); apply_rotary_emb multiplies
view_as_complex(x.reshape(..., -1, 2)) -- interleaved pairs.  use_qk_norm off.  Llama4TextAttention:
q/k/v/o without bias, GQA 4/2 repeat_kv, eager matmul * head_dim**-0.5 + mask, softmax.  Feed-forward
alternates a dense Llama4TextMLP (layers 0, 2) and Llama4TextMoe (layers 1, 3: sigmoid top-1 router over
4 experts in a fused gate_up_proj (E, D, 2I) parameter, plus shared_expert).  Llama4TextRMSNorm.
Slip: the model builds `causal_mask_mapping` with the "full_attention" entry taken from a helper that
returns None when the query covers all keys ("SDPA will use is_causal"), but the eager path used here
adds no mask when it gets None -- so the NoPE layer 3 attends to future tokens.  The chunked layers get
their mask.  No cache is used (model(ids) is the full forward; returns logits).
"""

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
        "model.layers.3.self_attn",
    ],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "model.layers.3.self_attn",
    "stage": "masked_scores",
    "mistake": "missing_mask",
    "style": "modeling_llama4.py text: complex freqs_cis on interleaved pairs (base 5e5), NoPE layer 3 with "
    "attn temperature tuning, GQA 4/2, alternating dense / sigmoid-routed MoE with shared expert; the "
    "full_attention mask is None for the eager NoPE layer",
}


class Llama4TextRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x):
        output = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return output * self.weight


class Llama4TextRotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        dim = config.head_dim
        self.inv_freq64 = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))

    def forward(self, x, position_ids):
        freqs = position_ids[:, :, None].to(torch.float64) * self.inv_freq64[None, None, :]
        freqs_cis = torch.polar(torch.ones_like(freqs), freqs)  # complex128
        return freqs_cis


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.to(torch.float64).reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.to(torch.float64).reshape(*xk.shape[:-1], -1, 2))
    xq_out = torch.view_as_real(xq_ * freqs_cis[:, :, None, :]).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis[:, :, None, :]).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


def eager_attention_forward(module, query, key, value, attention_mask, scaling):
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask[:, :, :, : key_states.shape[-2]]
    attn_weights = F.softmax(attn_weights, dim=-1)
    attn_output = torch.matmul(attn_weights, value_states)
    return attn_output.transpose(1, 2).contiguous()


class Llama4TextAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_attention_heads = config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim ** -0.5
        self.attn_scale = config.attn_scale
        self.floor_scale = config.floor_scale
        self.attn_temperature_tuning = config.attn_temperature_tuning
        self.use_rope = bool(config.no_rope_layers[layer_idx])
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states, position_embeddings, attention_mask, cache_position):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape)
        key_states = self.k_proj(hidden_states).view(*input_shape, -1, self.head_dim)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        if self.use_rope:
            query_states, key_states = apply_rotary_emb(query_states, key_states, position_embeddings)
        if self.attn_temperature_tuning and not self.use_rope:
            attn_scales = (
                torch.log(torch.floor((cache_position.to(torch.float64) + 1.0) / self.floor_scale) + 1.0)
                * self.attn_scale + 1.0
            )
            attn_scales = attn_scales.view((1, input_shape[-1], 1, 1)).expand((*input_shape, 1, 1))
            query_states = (query_states * attn_scales.to(query_states.dtype)).to(query_states.dtype)
        query_states = query_states.transpose(1, 2)
        key_states = key_states.transpose(1, 2)
        attn_output = eager_attention_forward(self, query_states, key_states, value_states, attention_mask,
                                              self.scaling)
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output)


class Llama4TextMLP(nn.Module):
    def __init__(self, config, intermediate_size=None):
        super().__init__()
        intermediate_size = intermediate_size or config.intermediate_size_mlp
        self.gate_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Llama4TextExperts(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_experts = config.num_local_experts
        self.expert_dim = config.intermediate_size
        self.hidden_size = config.hidden_size
        self.gate_up_proj = nn.Parameter(0.1 * torch.randn(self.num_experts, self.hidden_size, 2 * self.expert_dim))
        self.down_proj = nn.Parameter(0.1 * torch.randn(self.num_experts, self.expert_dim, self.hidden_size))

    def forward(self, hidden_states):
        hidden_states = hidden_states.view(self.num_experts, -1, self.hidden_size)
        gate_up = torch.bmm(hidden_states, self.gate_up_proj)
        gate, up = gate_up.chunk(2, dim=-1)
        next_states = torch.bmm(up * F.silu(gate), self.down_proj)
        return next_states.view(-1, self.hidden_size)


class Llama4TextMoe(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.hidden_dim = config.hidden_size
        self.num_experts = config.num_local_experts
        self.experts = Llama4TextExperts(config)
        self.router = nn.Linear(config.hidden_size, config.num_local_experts, bias=False)
        self.shared_expert = Llama4TextMLP(config, config.intermediate_size)

    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        router_logits = self.router(hidden_states)
        router_top_value, router_indices = torch.topk(router_logits, self.top_k, dim=1)
        router_scores = torch.full_like(router_logits, float("-inf")).scatter_(1, router_indices, router_top_value)
        router_scores = torch.sigmoid(router_scores.transpose(0, 1))
        routed_in = hidden_states.repeat(self.num_experts, 1) * router_scores.reshape(-1, 1)
        routed_out = self.experts(routed_in)
        out = self.shared_expert(hidden_states)
        out = out + routed_out.reshape(self.num_experts, -1, self.hidden_dim).sum(dim=0)
        return out


class Llama4TextDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = Llama4TextAttention(config, layer_idx)
        self.attention_type = "chunked_attention" if config.no_rope_layers[layer_idx] else "full_attention"
        self.is_moe_layer = layer_idx in config.moe_layers
        self.feed_forward = Llama4TextMoe(config) if self.is_moe_layer else Llama4TextMLP(config)
        self.input_layernorm = Llama4TextRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Llama4TextRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask, position_embeddings, cache_position):
        residual = hidden_states
        hidden_states = self.self_attn(self.input_layernorm(hidden_states), position_embeddings,
                                       attention_mask, cache_position)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.feed_forward(self.post_attention_layernorm(hidden_states))
        return residual + hidden_states.view(residual.shape)


def _additive_mask(allowed, dtype):
    zero = torch.zeros((), dtype=dtype)
    return torch.where(allowed, zero, torch.tensor(torch.finfo(dtype).min, dtype=dtype))[None, None]


def create_chunked_causal_mask(cache_position, kv_len, chunk_size, dtype):
    kv_idx = torch.arange(kv_len, device=cache_position.device)
    q_idx = cache_position[:, None]
    allowed = (kv_idx[None, :] <= q_idx) & (kv_idx[None, :] // chunk_size == q_idx // chunk_size)
    return _additive_mask(allowed, dtype)


def create_causal_mask(cache_position, kv_len, dtype):
    if cache_position.shape[0] == kv_len:
        # query covers every key: leave it to SDPA's is_causal
        return None
    kv_idx = torch.arange(kv_len, device=cache_position.device)
    return _additive_mask(kv_idx[None, :] <= cache_position[:, None], dtype)


class Llama4TextModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList([Llama4TextDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = Llama4TextRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Llama4TextRotaryEmbedding(config)

    def forward(self, input_ids):
        b, s = input_ids.shape
        hidden_states = self.embed_tokens(input_ids)
        cache_position = torch.arange(s, device=input_ids.device)
        position_ids = cache_position.unsqueeze(0).expand(b, -1)
        dtype = hidden_states.dtype
        causal_mask_mapping = {
            "full_attention": create_causal_mask(cache_position, s, dtype),
            "chunked_attention": create_chunked_causal_mask(cache_position, s, self.config.attention_chunk_size,
                                                            dtype),
        }
        freq_cis = self.rotary_emb(hidden_states, position_ids)
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(hidden_states, causal_mask_mapping[decoder_layer.attention_type],
                                          freq_cis, cache_position)
        return self.norm(hidden_states)


class Llama4ForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = Llama4TextModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids):
        return self.lm_head(self.model(input_ids))


def make_model():
    torch.manual_seed(1909)
    config = SimpleNamespace(
        vocab_size=96, hidden_size=64, intermediate_size=64, intermediate_size_mlp=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=500000.0, rms_norm_eps=1e-5,
        no_rope_layers=[1, 1, 1, 0], moe_layers=(1, 3), num_local_experts=4, num_experts_per_tok=1,
        attention_chunk_size=8192, attn_temperature_tuning=True, floor_scale=8192, attn_scale=0.1,
        pad_token_id=0,
    )
    model = Llama4ForCausalLM(config)
    g = torch.Generator().manual_seed(19091)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, Llama4TextRMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

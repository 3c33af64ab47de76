"""Hugging Face text-generation-inference flash_llama_modeling.py, ported to plain torch (no paged kernels).

FlashLlamaForCausalLM: model (FlashLlamaModel: embed_tokens, layers.N, norm) and lm_head.
FlashLlamaLayer: TGI's fused residual norms -- `input_layernorm(hidden, residual)` returns
(normed, new_residual) -- then self_attn, post_attention_layernorm(attn, residual), mlp
(gate_up_proj fused, down_proj).  FlashLlamaAttention: one `query_key_value` projection (q | k | v),
`o_proj`, GQA 6/2 through TGI's `kv_head_mapping = arange(kv).repeat_interleave(groups)` index_select,
PositionRotaryEmbedding (rotate_half, base 1e4) with a cos/sin cache grown on demand and indexed by
`position_ids`, softmax_scale = head_size**-0.5.  The "prefill" branch builds a causal mask from
`cu_seqlen_prefill`-style lengths; the "decode" branch (one new token) replaces paged_attention.
Cache: external `KVCache(n_layers=3)` passed as `cache=`; positions read from its length; logits tensor.
Slip: the decode branch builds its mask as `ones(q_len, kv_len).tril()` without shifting by the cached
length, so the new token attends to key 0 only.  The prefill branch, the full forward, are exact.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["model.layers.0.self_attn", "model.layers.1.self_attn", "model.layers.2.self_attn"],
    "kind": "causal-multihead",
    "cache": "book-cache",
    "decode": {"mistake": "cache_mask", "step": 0, "layer": "model.layers.0.self_attn"},
    "style": "TGI flash_llama_modeling.py: fused query_key_value, kv_head_mapping index_select (GQA 6/2), fused "
    "residual norms, gate_up_proj; decode-branch mask ones(q, kv).tril() not shifted by the cache length",
}


class KVCache:
    def __init__(self, n_layers):
        self.k = [None] * n_layers
        self.v = [None] * n_layers
        self.seqlen = 0

    def store(self, layer_id, key, value):
        if self.k[layer_id] is None:
            self.k[layer_id], self.v[layer_id] = key, value
        else:
            self.k[layer_id] = torch.cat([self.k[layer_id], key], dim=1)
            self.v[layer_id] = torch.cat([self.v[layer_id], value], dim=1)
        return self.k[layer_id], self.v[layer_id]


class FastRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states, residual=None):
        if residual is not None:
            hidden_states = hidden_states + residual
        residual = hidden_states
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * hidden_states * torch.rsqrt(variance + self.variance_epsilon), residual


class PositionRotaryEmbedding(nn.Module):
    def __init__(self, dim, base=10000.0):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)),
                             persistent=False)
        self._seq_len_cached = 0
        self._cos_cached = self._sin_cached = None

    def _update_cos_sin_cache(self, seqlen):
        if seqlen > self._seq_len_cached:
            self._seq_len_cached = seqlen
            t = torch.arange(seqlen, dtype=torch.float64)
            freqs = torch.outer(t, self.inv_freq.to(torch.float64))
            self._cos_cached, self._sin_cached = torch.cos(freqs), torch.sin(freqs)

    def get_cos_sin(self, position_ids, max_s, dtype):
        self._update_cos_sin_cache(max_s)
        return self._cos_cached[position_ids].to(dtype), self._sin_cached[position_ids].to(dtype)

    @staticmethod
    def forward(x, cos, sin):
        # x: (b, s, h, d); cos/sin: (b, s, d/2) -> halves layout
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class FlashLlamaAttention(nn.Module):
    def __init__(self, config, layer_id):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.head_size = config.hidden_size // self.num_heads
        self.softmax_scale = self.head_size ** -0.5
        self.query_key_value = nn.Linear(config.hidden_size, (self.num_heads + 2 * self.num_key_value_heads) * self.head_size,
                                         bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_size, config.hidden_size, bias=False)
        self.rotary_emb = PositionRotaryEmbedding(self.head_size, config.rope_theta)
        self.num_groups = self.num_heads // self.num_key_value_heads
        self.register_buffer("kv_head_mapping", torch.arange(self.num_key_value_heads).repeat_interleave(self.num_groups),
                             persistent=False)

    def forward(self, hidden_states, position_ids, max_s, cache=None, prefill=True):
        b, s, _ = hidden_states.shape
        qkv = self.query_key_value(hidden_states)
        query, kv = qkv.split([self.head_size * self.num_heads, 2 * self.head_size * self.num_key_value_heads], dim=-1)
        query = query.view(b, s, self.num_heads, self.head_size)
        kv = kv.view(b, s, 2, self.num_key_value_heads, self.head_size)
        cos, sin = self.rotary_emb.get_cos_sin(position_ids, max_s, query.dtype)
        query = self.rotary_emb(query, cos, sin)
        key = self.rotary_emb(kv[:, :, 0], cos, sin)
        value = kv[:, :, 1]
        if cache is not None:
            key, value = cache.store(self.layer_id, key, value)
        kv_len = key.shape[1]
        key = key.index_select(2, self.kv_head_mapping)
        value = value.index_select(2, self.kv_head_mapping)
        scores = torch.einsum("bqhd,bkhd->bhqk", query, key) * self.softmax_scale
        if prefill:
            offset = kv_len - s
            allowed = torch.arange(kv_len)[None, :] <= (torch.arange(s)[:, None] + offset)
        else:
            # stands in for paged_attention's block-table walk
            allowed = torch.ones(s, kv_len, dtype=torch.bool).tril()
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        attn_output = torch.einsum("bhqk,bkhd->bqhd", probs, value)
        return self.o_proj(attn_output.reshape(b, s, self.num_heads * self.head_size))


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, hidden_states):
        gate_up_states = self.gate_up_proj(hidden_states).view(*hidden_states.shape[:-1], 2, self.intermediate_size)
        return self.down_proj(F.silu(gate_up_states[..., 0, :]) * gate_up_states[..., 1, :])


class FlashLlamaLayer(nn.Module):
    def __init__(self, config, layer_id):
        super().__init__()
        self.self_attn = FlashLlamaAttention(config, layer_id)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = FastRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = FastRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, residual, position_ids, max_s, cache, prefill):
        normed_hidden_states, res = self.input_layernorm(hidden_states, residual)
        attn_output = self.self_attn(normed_hidden_states, position_ids, max_s, cache, prefill)
        normed_attn_res_output, attn_res = self.post_attention_layernorm(attn_output, res)
        return self.mlp(normed_attn_res_output), attn_res


class FlashLlamaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([FlashLlamaLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = FastRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids, cache=None):
        b, s = input_ids.shape
        start = 0 if cache is None else cache.seqlen
        position_ids = torch.arange(start, start + s, device=input_ids.device)[None].expand(b, -1)
        max_s = start + s
        prefill = cache is None or start == 0
        hidden_states = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(hidden_states, residual, position_ids, max_s, cache, prefill)
        if cache is not None:
            cache.seqlen = max_s
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class Config:
    vocab_size = 96
    hidden_size = 96
    intermediate_size = 192
    num_hidden_layers = 3
    num_attention_heads = 6
    num_key_value_heads = 2
    rms_norm_eps = 1e-6
    rope_theta = 10000.0


class FlashLlamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = FlashLlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, cache=None):
        return self.lm_head(self.model(input_ids, cache))


def make_model():
    torch.manual_seed(1112)
    model = FlashLlamaForCausalLM(Config())
    g = torch.Generator().manual_seed(11121)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, FastRMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

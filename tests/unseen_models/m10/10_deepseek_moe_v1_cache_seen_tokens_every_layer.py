"""DeepSeek-MoE (v1, 16B family) remote code `modeling_deepseek.py` (llama-derived), small config, eager attention.

DeepseekForCausalLM: model (DeepseekModel: embed_tokens, layers.N, norm) and lm_head.
DeepseekDecoderLayer: input_layernorm -> self_attn -> + residual -> post_attention_layernorm -> mlp,
where mlp is a dense DeepseekMLP below `first_k_dense_replace` (layer 0) and a DeepseekMoE elsewhere
(MoEGate: softmax scores, top-2, no renormalisation; experts.N; shared_experts).
DeepseekAttention: MHA (4 heads, no GQA), q/k/v/o without bias, DeepseekRotaryEmbedding keeping
cos_cached/sin_cached (float64 here) grown to `seq_len = kv_seq_len` and gathered by position_ids,
rotate_half (halves) base 1e4, matmul / sqrt(hd), additive finfo.min mask, softmax.
Cache: hf, a `DeepseekCache` (key_cache/value_cache lists, update(k, v, layer_idx), get_seq_length(),
and a `seen_tokens` counter), created when use_cache=True; out.past_key_values.
Slip (decode only): the cache advances `seen_tokens` on every layer's update() (the `layer_idx == 0`
guard of transformers 4.36's DynamicCache was lost in the vendored copy), and DeepseekModel reads
`past_key_values_length = past_key_values.seen_tokens` for position_ids.  After an n-token prompt
through 3 layers the counter reads 3n, so step 0's token is rotated for position 3n instead of n.
The mask is built from the real key count (get_seq_length) and the cached keys are right, so only the
new token's positions are wrong.  Full forward and prompt pass are exact.
"""

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
    "style": "DeepSeek-MoE v1 modeling_deepseek.py: dense layer 0 then DeepseekMoE (MoEGate softmax top-2, shared_experts), "
    "MHA, cos_cached/sin_cached by position_ids, DeepseekCache; slip: seen_tokens advanced by every layer and used "
    "as past_key_values_length",
}


class DeepseekCache:
    def __init__(self):
        self.key_cache, self.value_cache = [], []
        self.seen_tokens = 0

    def get_seq_length(self, layer_idx=0):
        return 0 if len(self.key_cache) <= layer_idx else self.key_cache[layer_idx].shape[-2]

    def update(self, key_states, value_states, layer_idx):
        self.seen_tokens += key_states.shape[-2]
        if len(self.key_cache) <= layer_idx:
            self.key_cache.append(key_states)
            self.value_cache.append(value_states)
        else:
            self.key_cache[layer_idx] = torch.cat([self.key_cache[layer_idx], key_states], dim=-2)
            self.value_cache[layer_idx] = torch.cat([self.value_cache[layer_idx], value_states], dim=-2)
        return self.key_cache[layer_idx], self.value_cache[layer_idx]


class DeepseekRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class DeepseekRotaryEmbedding(nn.Module):
    def __init__(self, dim, max_position_embeddings=64, base=10000):
        super().__init__()
        self.dim, self.base = dim, base
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._set_cos_sin_cache(max_position_embeddings)

    def _set_cos_sin_cache(self, seq_len):
        self.max_seq_len_cached = seq_len
        t = torch.arange(seq_len, dtype=torch.float64, device=self.inv_freq.device)
        freqs = torch.outer(t, self.inv_freq.to(torch.float64))
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos_cached = emb.cos()
        self.sin_cached = emb.sin()

    def forward(self, x, seq_len=None):
        if seq_len > self.max_seq_len_cached:
            self._set_cos_sin_cache(seq_len)
        return self.cos_cached[:seq_len].to(device=x.device, dtype=x.dtype), self.sin_cached[:seq_len].to(
            device=x.device, dtype=x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids):
    cos = cos[position_ids].unsqueeze(1)
    sin = sin[position_ids].unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class DeepseekAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)
        self.rotary_emb = DeepseekRotaryEmbedding(self.head_dim, base=config.rope_theta)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None):
        bsz, q_len, _ = hidden_states.size()
        q = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        kv_seq_len = k.shape[-2]
        if past_key_value is not None:
            kv_seq_len += past_key_value.get_seq_length(self.layer_idx)
        cos, sin = self.rotary_emb(v, seq_len=max(kv_seq_len, int(position_ids.max()) + 1))
        q, k = apply_rotary_pos_emb(q, k, cos, sin, position_ids)
        if past_key_value is not None:
            k, v = past_key_value.update(k, v, self.layer_idx)
        attn_weights = torch.matmul(q, k.transpose(2, 3)) / (self.head_dim**0.5)
        attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1).to(q.dtype)
        attn_output = torch.matmul(attn_weights, v).transpose(1, 2).contiguous().reshape(bsz, q_len, -1)
        return self.o_proj(attn_output), attn_weights, past_key_value


class DeepseekMLP(nn.Module):
    def __init__(self, config, intermediate_size=None):
        super().__init__()
        inter = intermediate_size or config.intermediate_size
        self.gate_proj = nn.Linear(config.hidden_size, inter, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, inter, bias=False)
        self.down_proj = nn.Linear(inter, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoEGate(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.weight = nn.Parameter(torch.randn(config.n_routed_experts, config.hidden_size) * 0.1)

    def forward(self, hidden_states):
        scores = F.linear(hidden_states, self.weight).softmax(dim=-1)
        topk_weight, topk_idx = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        return topk_idx, topk_weight


class DeepseekMoE(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.experts = nn.ModuleList([DeepseekMLP(config, config.moe_intermediate_size)
                                      for _ in range(config.n_routed_experts)])
        self.gate = MoEGate(config)
        self.shared_experts = DeepseekMLP(config, config.moe_intermediate_size * config.n_shared_experts)

    def forward(self, hidden_states):
        shape = hidden_states.shape
        flat = hidden_states.view(-1, shape[-1])
        idx, w = self.gate(flat)
        y = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            y = y + (w * (idx == e).to(w.dtype)).sum(-1, keepdim=True) * expert(flat)
        return y.view(shape) + self.shared_experts(hidden_states)


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = DeepseekAttention(config, layer_idx)
        self.mlp = DeepseekMoE(config) if layer_idx >= config.first_k_dense_replace else DeepseekMLP(config)
        self.input_layernorm = DeepseekRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = DeepseekRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask, position_ids, past_key_value):
        residual = hidden_states
        hidden_states, _, _ = self.self_attn(self.input_layernorm(hidden_states), attention_mask=attention_mask,
                                             position_ids=position_ids, past_key_value=past_key_value)
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class DeepseekModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([DeepseekDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = DeepseekRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        batch_size, seq_length = input_ids.shape
        if use_cache and past_key_values is None:
            past_key_values = DeepseekCache()
        past_key_values_length = past_key_values.seen_tokens if past_key_values is not None else 0
        real_past = past_key_values.get_seq_length() if past_key_values is not None else 0
        position_ids = torch.arange(past_key_values_length, seq_length + past_key_values_length,
                                    dtype=torch.long, device=input_ids.device).unsqueeze(0)
        inputs_embeds = self.embed_tokens(input_ids)
        dtype = inputs_embeds.dtype
        rows = real_past + torch.arange(seq_length, device=input_ids.device)
        visible = torch.arange(real_past + seq_length, device=input_ids.device)[None, :] <= rows[:, None]
        attention_mask = torch.zeros(seq_length, real_past + seq_length, dtype=dtype, device=input_ids.device)
        attention_mask = attention_mask.masked_fill(~visible, torch.finfo(dtype).min)[None, None]
        hidden_states = inputs_embeds
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(hidden_states, attention_mask, position_ids, past_key_values)
        return self.norm(hidden_states), past_key_values


class DeepseekForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = DeepseekModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        hidden, past = self.model(input_ids, past_key_values=past_key_values, use_cache=use_cache)
        return SimpleNamespace(logits=self.lm_head(hidden), past_key_values=past if use_cache else None)


def make_model():
    torch.manual_seed(0)
    config = SimpleNamespace(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                             num_hidden_layers=3, num_attention_heads=4, rms_norm_eps=1e-6, rope_theta=10000.0,
                             first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=2)
    model = DeepseekForCausalLM(config)
    for m in model.modules():
        if isinstance(m, DeepseekRMSNorm):
            nn.init.uniform_(m.weight, 0.6, 1.4)
    return model.eval()

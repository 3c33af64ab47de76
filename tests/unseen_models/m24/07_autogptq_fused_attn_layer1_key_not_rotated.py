"""LLaMA with AutoGPTQ's fused attention swapped in (auto_gptq/nn_modules/fused_llama_attn.py).

AutoGPTQ's `inject_fused_attention` replaces every LlamaAttention by
FusedLlamaAttentionForQuantizedModel: the q/k/v projections are concatenated into one `qkv_proj`
(out features 3 * hidden), the output is split with `torch.split(qkv_states, self.hidden_size, dim=2)`,
heads are made with view/transpose, HF `rotate_half` rotary (base 1e4) is applied with cos/sin gathered
by `position_ids`, the legacy (key, value) tuple in (b, heads, seq, head_dim) is concatenated on dim 2,
and the attention itself is `F.scaled_dot_product_attention` (is_causal on the prompt, no mask on the
one-token step), then `o_proj`.  The quantised linear layers are plain nn.Linear here.
Tree: model.embed_tokens, model.layers.N (input_layernorm, self_attn, post_attention_layernorm, mlp),
model.norm, lm_head.  MHA 4 heads, 3 layers.
Cache: hf legacy tuples: `out = model(ids, use_cache=True)`, then
`model(tok, past_key_values=out.past_key_values, use_cache=True)`; logits in `out.logits`.
Slip: layer 1 was injected through AutoGPTQ's exllama-kernel path (`keys_rotated_in_kernel=True`),
which expects the quantised qkv kernel to rotate the keys in place and so only rotates the queries in
Python; with plain linear layers the keys of that layer are never rotated.  Cached decoding stores the
same unrotated keys, so it still equals this model's own full pass.
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
    "layer": "model.layers.1.self_attn",
    "stage": "rotated_keys",
    "mistake": "rope_missing",
    "style": "AutoGPTQ FusedLlamaAttentionForQuantizedModel: one qkv_proj split by hidden_size, rotate_half rotary "
    "gathered by position_ids, legacy (k, v) tuples cat on dim 2, F.scaled_dot_product_attention "
    "(is_causal on the prompt), o_proj; MHA 4 heads; layer 1 built with keys_rotated_in_kernel=True "
    "rotates only its queries",
}


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class LlamaRotaryEmbedding(nn.Module):
    def __init__(self, dim, base=10000.0):
        super().__init__()
        self.dim = dim
        self.base = base

    def forward(self, x, seq_len):
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2, dtype=torch.float64) / self.dim))
        t = torch.arange(seq_len, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1).to(x.device)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb_single(x, cos, sin, position_ids):
    cos = cos[position_ids].unsqueeze(1)
    sin = sin[position_ids].unsqueeze(1)
    return (x * cos) + (rotate_half(x) * sin)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids):
    cos = cos[position_ids].unsqueeze(1)
    sin = sin[position_ids].unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class FusedLlamaAttentionForQuantizedModel(nn.Module):
    def __init__(self, config, qkv_proj, o_proj, rotary_emb, keys_rotated_in_kernel=False):
        super().__init__()
        self.keys_rotated_in_kernel = keys_rotated_in_kernel
        self.config = config
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.qkv_proj = qkv_proj
        self.o_proj = o_proj
        self.rotary_emb = rotary_emb

    def _shape(self, tensor, seq_len, bsz):
        return tensor.view(bsz, seq_len, self.num_heads, self.head_dim).transpose(1, 2).contiguous()

    def forward(self, hidden_states, past_key_value=None, position_ids=None, use_cache=False):
        bsz, q_len, _ = hidden_states.size()
        qkv_states = self.qkv_proj(hidden_states)
        query_states, key_states, value_states = torch.split(qkv_states, self.hidden_size, dim=2)
        query_states = self._shape(query_states, q_len, bsz)
        key_states = self._shape(key_states, q_len, bsz)
        value_states = self._shape(value_states, q_len, bsz)

        kv_seq_len = key_states.shape[-2]
        if past_key_value is not None:
            kv_seq_len += past_key_value[0].shape[-2]
        cos, sin = self.rotary_emb(value_states, seq_len=kv_seq_len)
        if self.keys_rotated_in_kernel:
            query_states = apply_rotary_pos_emb_single(query_states, cos, sin, position_ids)
        else:
            query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin, position_ids)

        if past_key_value is not None:
            key_states = torch.cat([past_key_value[0], key_states], dim=2)
            value_states = torch.cat([past_key_value[1], value_states], dim=2)
        past_key_value = (key_states, value_states) if use_cache else None

        attn_output = F.scaled_dot_product_attention(
            query_states, key_states, value_states, is_causal=(q_len > 1 and kv_seq_len == q_len)
        )
        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, self.hidden_size)
        return self.o_proj(attn_output), None, past_key_value


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        h = config.hidden_size
        # what inject_fused_attention builds from a LlamaAttention's q_proj/k_proj/v_proj
        qkv_proj = nn.Linear(h, 3 * h, bias=False)
        o_proj = nn.Linear(h, h, bias=False)
        self.self_attn = FusedLlamaAttentionForQuantizedModel(
            config, qkv_proj, o_proj, LlamaRotaryEmbedding(h // config.num_attention_heads),
            keys_rotated_in_kernel=(layer_idx in config.exllama_layers),
        )
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(h, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_ids, past_key_value=None, use_cache=False):
        residual = hidden_states
        hidden_states, _, present = self.self_attn(
            self.input_layernorm(hidden_states), past_key_value=past_key_value,
            position_ids=position_ids, use_cache=use_cache,
        )
        hidden_states = residual + hidden_states
        hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states, present


class LlamaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        bsz, seq_length = input_ids.shape
        past_key_values_length = past_key_values[0][0].shape[2] if past_key_values is not None else 0
        position_ids = torch.arange(
            past_key_values_length, seq_length + past_key_values_length, device=input_ids.device
        ).unsqueeze(0).expand(bsz, -1)
        hidden_states = self.embed_tokens(input_ids)
        next_cache = ()
        for idx, layer in enumerate(self.layers):
            past = past_key_values[idx] if past_key_values is not None else None
            hidden_states, present = layer(hidden_states, position_ids, past, use_cache)
            next_cache += (present,)
        return self.norm(hidden_states), (next_cache if use_cache else None)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        hidden, cache = self.model(input_ids, past_key_values=past_key_values, use_cache=use_cache)
        return SimpleNamespace(logits=self.lm_head(hidden), past_key_values=cache)


def make_model():
    torch.manual_seed(2407)
    config = SimpleNamespace(
        vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
        num_attention_heads=4, rms_norm_eps=1e-6, exllama_layers=(1,),
    )
    model = LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(24071)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LlamaRMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

"""OrionStar Orion-14B (modeling_orion.py) decoder (small, random weights).

OrionForCausalLM: model (OrionModel: embed_tokens, layers.N, norm) and lm_head.  Orion uses
nn.LayerNorm (weight and bias) for input_layernorm / post_attention_layernorm / norm.  OrionAttention:
q/k/v/o without bias, GQA 4 query / 2 kv heads (`repeat_kv`), rotary halves (rotate_half) from an
OrionRotaryEmbedding with cos_cached/sin_cached, base 1e4, additive finfo.min mask, softmax upcast to at least float32.
Cache: hf tuples of per-layer `(k, v)` in (b, kv, s, d):
`out = model(ids, use_cache=True)`, `model(tok, past_key_values=out.past_key_values, use_cache=True)`;
logits in `out.logits`.
Slip: the prompt path (no past) caches its keys pre-multiplied by 1/sqrt(head_dim)
(`present = (key_states * self.scaling, value_states)`, written for a fused decode kernel that skips
the query scale), while its own attention uses the plain keys, so the full forward and the prompt pass
are exact.  The decoding path still scales the query and concatenates onto the pre-scaled cached keys,
so every decoded token's scores against the prompt keys carry the scale twice.  Rotary positions,
mask and cache length are right.
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
    ],
    "kind": "causal-multihead",
    "cache": "hf",
    "decode": {
        "mistake": "cache_other",
        "step": 0,
        "layer": "model.layers.0.self_attn",
    },
    "style": "modeling_orion.py: nn.LayerNorm norms with bias, GQA 4/2 repeat_kv, cos_cached rotate_half, (k, v) "
    "tuples; prompt path caches keys pre-multiplied by 1/sqrt(hd), decode path still scales the query",
}


class OrionRotaryEmbedding(nn.Module):
    def __init__(self, dim, max_position_embeddings=128, base=10000):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        t = torch.arange(max_position_embeddings).float()
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def forward(self, x, position_ids):
        return self.cos_cached[position_ids].to(x.dtype), self.sin_cached[position_ids].to(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def repeat_kv(hidden_states, n_rep):
    b, kv, s, d = hidden_states.shape
    return hidden_states[:, :, None].expand(b, kv, n_rep, s, d).reshape(b, kv * n_rep, s, d)


class OrionAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=False)
        self.rotary_emb = OrionRotaryEmbedding(self.head_dim, config.max_position_embeddings)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None, use_cache=False):
        bsz, q_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary_emb(value_states, position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        query_states = query_states * cos + rotate_half(query_states) * sin
        key_states = key_states * cos + rotate_half(key_states) * sin
        query_states = query_states * self.scaling
        if past_key_value is None:
            # prompt: store keys pre-multiplied by the scale for the fused decode kernel
            present = (key_states * self.scaling, value_states)
        else:
            key_states = torch.cat([past_key_value[0], key_states], dim=2)
            value_states = torch.cat([past_key_value[1], value_states], dim=2)
            present = (key_states, value_states)
        past_key_value = present if use_cache else None
        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3))
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.promote_types(query_states.dtype, torch.float32)).to(query_states.dtype)
        attn_output = torch.matmul(attn_weights, value_states).transpose(1, 2).reshape(bsz, q_len, self.hidden_size)
        return self.o_proj(attn_output), None, past_key_value


class OrionMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class OrionDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = OrionAttention(config)
        self.mlp = OrionMLP(config)
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask, position_ids, past_key_value=None, use_cache=False):
        residual = hidden_states
        hidden_states, _, present = self.self_attn(
            hidden_states=self.input_layernorm(hidden_states), attention_mask=attention_mask,
            position_ids=position_ids, past_key_value=past_key_value, use_cache=use_cache)
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states)), present


class OrionModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([OrionDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        bsz, seq_length = input_ids.shape
        past_len = past_key_values[0][0].shape[2] if past_key_values is not None else 0
        position_ids = torch.arange(past_len, past_len + seq_length, device=input_ids.device)[None]
        h = self.embed_tokens(input_ids)
        mask = torch.full((seq_length, seq_length), torch.finfo(h.dtype).min, dtype=h.dtype, device=h.device).triu(1)
        mask = torch.cat([torch.zeros(seq_length, past_len, dtype=h.dtype, device=h.device), mask], dim=-1)
        mask = mask[None, None].expand(bsz, 1, seq_length, past_len + seq_length)
        presents = () if use_cache else None
        for idx, layer in enumerate(self.layers):
            past = past_key_values[idx] if past_key_values is not None else None
            h, present = layer(h, mask, position_ids, past, use_cache)
            if use_cache:
                presents += (present,)
        return self.norm(h), presents


class OrionForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = OrionModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        h, cache = self.model(input_ids, past_key_values=past_key_values, use_cache=use_cache)
        return SimpleNamespace(logits=self.lm_head(h), past_key_values=cache)


def make_model():
    torch.manual_seed(913)
    config = SimpleNamespace(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                             rms_norm_eps=1e-5)
    model = OrionForCausalLM(config)
    g = torch.Generator().manual_seed(9131)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model.eval()

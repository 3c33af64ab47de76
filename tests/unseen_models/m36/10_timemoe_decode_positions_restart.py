"""Time-MoE (Maple728/Time-MoE, modeling_time_moe.py) as a token model over quantised series values.

TimeMoeForPrediction: a fixed bin_centers buffer turns ids into values, model (TimeMoeModel:
embed_layer = TimeMoeInputEmbedding (silu(gate_layer(x)) * emb_layer(x)), layers.N, norm) and one
lm_heads output layer giving a logit per bin.  TimeMoeDecoderLayer: input_layernorm -> self_attn ->
residual -> post_attention_layernorm -> ffn_layer (top-2 of 4 experts plus a sigmoid-gated shared
expert) -> residual.  TimeMoeAttention is Qwen2's: q/k/v_proj with bias, o_proj without, GQA 4 query /
2 kv heads (repeat_kv), rotate_half rotary (base 1e4, table built in float64 at call time), additive
finfo.min causal mask offset by the cached length, softmax, matmul.
Cache: hf with a DynamicCache object: `out = model(ids, use_cache=True)`, then
`model(tok, past_key_values=out.past_key_values, use_cache=True)`; logits in `out.logits`.
Slip (decoding only): position_ids are arange(seq_len) for every call, never offset by
the cached length, so each decoded token is rotated as position 0.  The full pass is exact.
"""

import math
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
    "style": "Time-MoE (Maple728/Time-MoE modeling_time_moe.py): gated input embedding of bin values, "
    "pre-RMSNorm, Qwen2-copied attention (q/k/v bias, GQA 4/2, rotate_half rotary 1e4), "
    "top-2 sparse experts + gated shared expert, DynamicCache; decode slip: position_ids = "
    "arange(seq_len), never offset by the cached length",
}


class TimeMoeRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class TimeMoeRotaryEmbedding(nn.Module):
    def __init__(self, dim, base=10000.0):
        super().__init__()
        self.dim = dim
        self.base = base

    def forward(self, x, seq_len):
        # the table is built in float64 for positions 0..seq_len-1 and cast to the activations
        inv_freq = 1.0 / (
            self.base
            ** (torch.arange(0, self.dim, 2, dtype=torch.float64, device=x.device) / self.dim)
        )
        t = torch.arange(seq_len, dtype=torch.float64, device=x.device)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids):
    cos = cos[position_ids].unsqueeze(1)
    sin = sin[position_ids].unsqueeze(1)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(
        batch, num_key_value_heads, n_rep, slen, head_dim
    )
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class DynamicCache:
    """A small stand-in for transformers' DynamicCache: per-layer key / value lists, (b, kv, T, d)."""

    def __init__(self):
        self.key_cache = []
        self.value_cache = []

    def __len__(self):
        return len(self.key_cache)

    def get_seq_length(self, layer_idx=0):
        if len(self.key_cache) <= layer_idx:
            return 0
        return self.key_cache[layer_idx].shape[-2]

    def get_usable_length(self, new_seq_length, layer_idx=0):
        return self.get_seq_length(layer_idx)

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        if len(self.key_cache) <= layer_idx:
            self.key_cache.append(key_states)
            self.value_cache.append(value_states)
        else:
            self.key_cache[layer_idx] = torch.cat([self.key_cache[layer_idx], key_states], dim=-2)
            self.value_cache[layer_idx] = torch.cat(
                [self.value_cache[layer_idx], value_states], dim=-2
            )
        return self.key_cache[layer_idx], self.value_cache[layer_idx]


class TimeMoeAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.is_causal = True
        self.rotate_keys = layer_idx not in config.unrotated_key_layers
        self.use_o_proj = layer_idx not in config.skip_o_proj_layers
        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(
            self.hidden_size, self.num_key_value_heads * self.head_dim, bias=True
        )
        self.v_proj = nn.Linear(
            self.hidden_size, self.num_key_value_heads * self.head_dim, bias=True
        )
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=False)
        self.rotary_emb = TimeMoeRotaryEmbedding(self.head_dim, base=config.rope_theta)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None):
        bsz, q_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states)
        key_states = self.k_proj(hidden_states)
        value_states = self.v_proj(hidden_states)
        query_states = query_states.view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = key_states.view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(
            1, 2
        )
        value_states = value_states.view(
            bsz, q_len, self.num_key_value_heads, self.head_dim
        ).transpose(1, 2)

        kv_seq_len = key_states.shape[-2]
        if past_key_value is not None:
            kv_seq_len += past_key_value.get_usable_length(kv_seq_len, self.layer_idx)
        cos, sin = self.rotary_emb(value_states, seq_len=kv_seq_len)
        rotated_q, rotated_k = apply_rotary_pos_emb(
            query_states, key_states, cos, sin, position_ids
        )
        query_states = rotated_q
        if self.rotate_keys:
            key_states = rotated_k

        if past_key_value is not None:
            key_states, value_states = past_key_value.update(
                key_states, value_states, self.layer_idx
            )

        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)

        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(
            self.head_dim
        )
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1).to(query_states.dtype)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).contiguous().reshape(bsz, q_len, self.hidden_size)
        if self.use_o_proj:
            attn_output = self.o_proj(attn_output)
        return attn_output, None, past_key_value


class TimeMoeTemporalBlock(nn.Module):
    def __init__(self, hidden_size, intermediate_size):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TimeMoeSparseExpertsLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.num_experts
        inter = config.intermediate_size // self.top_k
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList(
            [TimeMoeTemporalBlock(config.hidden_size, inter) for _ in range(self.num_experts)]
        )
        self.shared_expert = TimeMoeTemporalBlock(config.hidden_size, config.intermediate_size)
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, hidden_states):
        b, s, d = hidden_states.shape
        flat = hidden_states.reshape(-1, d)
        routing = F.softmax(self.gate(flat), dim=1)
        routing, selected = torch.topk(routing, self.top_k, dim=-1)
        out = torch.zeros_like(flat)
        for e in range(self.num_experts):
            rows, slot = torch.where(selected == e)
            if rows.numel():
                out.index_add_(0, rows, self.experts[e](flat[rows]) * routing[rows, slot, None])
        out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out.reshape(b, s, d)


class TimeMoeDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = TimeMoeAttention(config, layer_idx)
        self.ffn_layer = TimeMoeSparseExpertsLayer(config)
        self.input_layernorm = TimeMoeRMSNorm(config.hidden_size)
        self.post_attention_layernorm = TimeMoeRMSNorm(config.hidden_size)

    def forward(self, hidden_states, attention_mask, position_ids, past_key_value):
        residual = hidden_states
        hidden_states, _, _ = self.self_attn(
            self.input_layernorm(hidden_states), attention_mask, position_ids, past_key_value
        )
        hidden_states = residual + hidden_states
        return hidden_states + self.ffn_layer(self.post_attention_layernorm(hidden_states))


class TimeMoeInputEmbedding(nn.Module):
    def __init__(self, input_size, hidden_size):
        super().__init__()
        self.emb_layer = nn.Linear(input_size, hidden_size, bias=False)
        self.gate_layer = nn.Linear(input_size, hidden_size, bias=False)

    def forward(self, x):
        return F.silu(self.gate_layer(x)) * self.emb_layer(x)


class TimeMoeModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_layer = TimeMoeInputEmbedding(config.input_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [TimeMoeDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = TimeMoeRMSNorm(config.hidden_size)

    def forward(self, values, past_key_values=None):
        bsz, seq_len, _ = values.shape
        past_len = past_key_values.get_seq_length() if past_key_values is not None else 0
        # positions for this call's rows only (the training-time arange, never offset)
        position_ids = torch.arange(seq_len, device=values.device)[None].expand(bsz, -1)
        hidden_states = self.embed_layer(values)
        dtype = hidden_states.dtype
        total = past_len + seq_len
        allowed = torch.ones(seq_len, total, dtype=torch.bool, device=values.device).tril(
            diagonal=past_len
        )
        mask = torch.zeros(seq_len, total, dtype=dtype, device=values.device).masked_fill(
            ~allowed, torch.finfo(dtype).min
        )[None, None]
        for layer in self.layers:
            hidden_states = layer(hidden_states, mask, position_ids, past_key_values)
        return self.norm(hidden_states)


class TimeMoeOutputLayer(nn.Module):
    def __init__(self, hidden_size, horizon_length):
        super().__init__()
        self.out_layer = nn.Linear(hidden_size, horizon_length, bias=False)

    def forward(self, x):
        return self.out_layer(x)


class TimeMoeForPrediction(nn.Module):
    """Token ids are quantised series values: id -> bin centre (a fixed buffer) -> Time-MoE; the one
    output head gives a logit per bin."""

    def __init__(self, config):
        super().__init__()
        self.register_buffer(
            "bin_centers",
            torch.linspace(-3.0, 3.0, config.vocab_size).unsqueeze(-1),
            persistent=False,
        )
        self.model = TimeMoeModel(config)
        self.lm_heads = nn.ModuleList([TimeMoeOutputLayer(config.hidden_size, config.vocab_size)])

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        values = self.bin_centers[input_ids].to(self.lm_heads[0].out_layer.weight.dtype)
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache()
        hidden = self.model(values, past_key_values=past_key_values if use_cache else None)
        logits = self.lm_heads[0](hidden)
        return SimpleNamespace(
            logits=logits, past_key_values=past_key_values if use_cache else None
        )


def make_model():
    torch.manual_seed(3610)
    config = SimpleNamespace(
        vocab_size=96,
        input_size=1,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        rope_theta=10000.0,
        unrotated_key_layers=[],
        skip_o_proj_layers=[],
    )
    model = TimeMoeForPrediction(config)
    g = torch.Generator().manual_seed(3610 * 10 + 1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, TimeMoeRMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
            if isinstance(m, TimeMoeInputEmbedding):
                m.emb_layer.weight.mul_(3.0)
                m.gate_layer.weight.mul_(3.0)
    return model.eval()

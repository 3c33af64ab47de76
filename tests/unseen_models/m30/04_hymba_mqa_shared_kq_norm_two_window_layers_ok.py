"""NVIDIA Hymba (nvidia/Hymba-1.5B, modeling_hymba.py), attention heads only.

HymbaForCausalLM: model (HymbaModel: embed_tokens, layers.N, final_layernorm) and lm_head.  Each
HymbaDecoderLayer: input_layernorm -> mamba (HymbaBlock: self_attn -> pre_avg_layernorm1 ->
out_proj; the parallel Mamba heads of the hybrid block are not built) -> residual, then
pre_moe_layernorm -> moe (a gated SiLU MLP) -> residual.  HymbaAttention is built with
attn_only_wo_proj: q_proj/k_proj/v_proj and no o_proj of its own (the block's out_proj follows a
norm).  kq_norm rms (one gain shared by all heads), applied before the rotary (Llama
rotate_half, halves, theta 1e4, tables in float64 at call time).  Layers in global_attn_idx [0,
3] attend to everything; the others use sliding_window 8 (a query sees 8 keys, itself included).
The mask is made from absolute query/key positions, masked_fill finfo.min.  Cross-layer KV reuse
and meta tokens not built. Cache: hf: `out = model(ids, use_cache=True)`, then `model(tok,
past_key_values=out.past_key_values, use_cache=True)`; a HymbaHybridCache (global layers
concatenate; sliding-window layers keep a rolling buffer of the last 7 keys with their
positions; get_seq_length()); 64 positions at most.
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
        "model.layers.0.mamba.self_attn",
        "model.layers.1.mamba.self_attn",
        "model.layers.2.mamba.self_attn",
        "model.layers.3.mamba.self_attn",
    ],
    "kind": "causal-multihead",
    "cache": "hf",
    "style": "Hymba attention heads: MQA 4/1, kq_norm 'rms' (one head_dim gain shared by "
    "all heads) before halves rotary, global layers 0 and 3, layers 1 and 2 "
    "sliding window 8 with rolling buffers, no o_proj in the attention",
}


class HymbaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states


class PerheadHymbaRMSNorm(nn.Module):
    # one gain vector per head; input (b, heads, s, d)
    def __init__(self, hidden_size, num_heads, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(num_heads, hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight[None, :, None, :] * hidden_states


class HymbaRotaryEmbedding(nn.Module):
    def __init__(self, dim, base=10000.0):
        super().__init__()
        self.dim = dim
        self.base = base

    def forward(self, x, position_ids):
        inv_freq = 1.0 / (
            self.base
            ** (torch.arange(0, self.dim, 2, dtype=torch.float64, device=x.device) / self.dim)
        )
        freqs = position_ids.to(torch.float64)[..., None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(
        batch, num_key_value_heads, n_rep, slen, head_dim
    )
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class HymbaHybridCache:
    """Per-layer key/value lists.  Global layers grow by concatenation; sliding-window layers keep a
    rolling buffer of the last keys any later query can still see, with their absolute positions."""

    def __init__(self, config, batch_size, dtype, device):
        n = config.num_hidden_layers
        self.keep = [
            None if i in config.global_attn_idx else config.sliding_window - 1 for i in range(n)
        ]
        self.key_cache = [None] * n
        self.value_cache = [None] * n
        self.pos_cache = [None] * n
        self.seen_tokens = 0

    def get_seq_length(self, layer_idx=0):
        return self.seen_tokens

    def update(self, key_states, value_states, positions, layer_idx):
        if self.key_cache[layer_idx] is None:
            k, v, p = key_states, value_states, positions
        else:
            k = torch.cat([self.key_cache[layer_idx], key_states], dim=-2)
            v = torch.cat([self.value_cache[layer_idx], value_states], dim=-2)
            p = torch.cat([self.pos_cache[layer_idx], positions], dim=-1)
        keep = self.keep[layer_idx]
        if keep is None:
            self.key_cache[layer_idx], self.value_cache[layer_idx], self.pos_cache[layer_idx] = (
                k,
                v,
                p,
            )
        else:
            self.key_cache[layer_idx] = k[:, :, -keep:]
            self.value_cache[layer_idx] = v[:, :, -keep:]
            self.pos_cache[layer_idx] = p[-keep:]
        return k, v, p


class HymbaAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.kq_head_dim = self.head_dim
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.is_global = layer_idx in config.global_attn_idx
        self.sliding_window = None if self.is_global else config.sliding_window
        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(
            self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False
        )
        self.v_proj = nn.Linear(
            self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False
        )
        # attn_only_wo_proj: the output projection lives in the enclosing HymbaBlock
        if config.kq_norm == "rms":
            self.k_norm = HymbaRMSNorm(self.kq_head_dim)
            self.q_norm = HymbaRMSNorm(self.kq_head_dim)
        else:
            self.k_norm = PerheadHymbaRMSNorm(self.kq_head_dim, self.num_key_value_heads)
            self.q_norm = PerheadHymbaRMSNorm(self.kq_head_dim, self.num_heads)
        self.rotary_emb = HymbaRotaryEmbedding(self.head_dim, base=config.rope_theta)

    def forward(self, hidden_states, position_ids, past_key_value=None):
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
        cos, sin = self.rotary_emb(value_states, position_ids)
        query_states = self.q_norm(query_states)
        key_states = self.k_norm(key_states)
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        q_pos = position_ids[0]
        k_pos = q_pos
        if past_key_value is not None:
            key_states, value_states, k_pos = past_key_value.update(
                key_states, value_states, q_pos, self.layer_idx
            )
        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(
            self.head_dim
        )
        dist = q_pos[:, None] - k_pos[None, :]
        allowed = dist >= 0
        if self.sliding_window is not None:
            allowed = allowed & (dist < self.sliding_window)
        min_value = torch.finfo(attn_weights.dtype).min
        attn_weights = attn_weights.masked_fill(~allowed[None, None], min_value)
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).contiguous()
        return attn_output.reshape(bsz, q_len, self.num_heads * self.head_dim)


class HymbaBlock(nn.Module):
    """The hybrid-head block with only its attention heads built (the parallel Mamba heads are left
    out): attention -> pre_avg_layernorm1 -> out_proj."""

    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = HymbaAttention(config, layer_idx)
        self.pre_avg_layernorm1 = HymbaRMSNorm(config.hidden_size)
        self.out_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, hidden_states, position_ids, past_key_value=None):
        attn_out = self.self_attn(hidden_states, position_ids, past_key_value)
        return self.out_proj(self.pre_avg_layernorm1(attn_out))


class HymbaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size * 2, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class HymbaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.input_layernorm = HymbaRMSNorm(config.hidden_size)
        self.mamba = HymbaBlock(config, layer_idx)
        self.pre_moe_layernorm = HymbaRMSNorm(config.hidden_size)
        self.moe = HymbaMLP(config)

    def forward(self, hidden_states, position_ids, past_key_value=None):
        hidden_states = hidden_states + self.mamba(
            self.input_layernorm(hidden_states), position_ids, past_key_value
        )
        return hidden_states + self.moe(self.pre_moe_layernorm(hidden_states))


class HymbaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [HymbaDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.final_layernorm = HymbaRMSNorm(config.hidden_size)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        bsz, seq_len = input_ids.shape
        hidden_states = self.embed_tokens(input_ids)
        if use_cache and past_key_values is None:
            past_key_values = HymbaHybridCache(
                self.config, bsz, hidden_states.dtype, hidden_states.device
            )
        past_seen = past_key_values.get_seq_length() if past_key_values is not None else 0
        if past_seen + seq_len > self.config.max_position_embeddings:
            raise ValueError("sequence longer than max_position_embeddings")
        position_ids = torch.arange(past_seen, past_seen + seq_len, device=input_ids.device)
        position_ids = position_ids.unsqueeze(0).expand(bsz, -1)
        for layer in self.layers:
            hidden_states = layer(
                hidden_states, position_ids, past_key_values if use_cache else None
            )
        if use_cache:
            past_key_values.seen_tokens += seq_len
        return self.final_layernorm(hidden_states), (past_key_values if use_cache else None)


class HymbaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = HymbaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        hidden, cache = self.model(input_ids, past_key_values=past_key_values, use_cache=use_cache)
        return SimpleNamespace(logits=self.lm_head(hidden), past_key_values=cache)


def make_model():
    torch.manual_seed(3004)
    config = SimpleNamespace(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=1,
        global_attn_idx=[0, 3],
        sliding_window=8,
        kq_norm="rms",
        kq_norm_after_rope_idx=(),
        rope_theta=10000.0,
        max_position_embeddings=64,
    )
    model = HymbaForCausalLM(config)
    g = torch.Generator().manual_seed(30041)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (HymbaRMSNorm, PerheadHymbaRMSNorm)):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

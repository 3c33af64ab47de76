"""aws-neuron/neuronx-distributed-inference (NxDI) Mistral with sliding-window attention
(models/mistral/modeling_mistral.py on modules/attention/attention_base.py NeuronAttentionBase and
modules/kvcache/kv_cache_manager.py), with the Neuron kernels and parallel layers written in torch.

Kept: `embed_tokens`, `layers.N` (`input_layernorm`, `self_attn`, `post_attention_layernorm`, `mlp`
gate/up/down), `norm`, `lm_head`, and the model-level `kv_mgr` (KVCacheManager) holding
`past_key_values`, one (k, v) buffer pair per layer of (batch <= 4, kv_heads, 64, head_dim).
NeuronAttentionBase: `qkv_proj` (GroupQueryAttention_QKV with `q_proj`/`k_proj`/`v_proj`), `o_proj`
(GroupQueryAttention_O with its `o_proj`), `rotary_emb` (rotate_half, theta 1e4), GQA 4/2 via
`repeat_kv`, `sliding_window` = 3 from the config (a query sees itself and the 2 keys before it).
Context encoding (`attention_context_encode`) builds the causal + window mask and writes the prompt
k/v into the manager; token generation (`attention_tokengen`) scores the new query against the prior
cache and against its own active key separately, masks the prior part, and combines the two with
`manual_softmax(prior_scores, active_scores)`.
Cache: book-buffers: `model.reset_kv_cache()`, `model(prompt, use_cache=True)`,
`model(tok, use_cache=True)`; `model(ids)` is a plain context encoding.  Returns logits.
Slip: the token-generation prior mask is the generic one, `position_ids > arange(max_len)` (key
already written), built before the model learned about windows: during decoding the new token sees
every cached key instead of the last 2, so from a 3-token prompt on the first decoded step diverges
(with a 1- or 2-token prompt, the first step whose cache holds 3 or more keys).  Context encoding is
exact, so the full forward and the prompt pass are exact.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["layers.0.self_attn", "layers.1.self_attn", "layers.2.self_attn"],
    "kind": "causal-multihead",
    "cache": "book-buffers",
    "decode": {
        "mistake": "cache_mask",
        "step": 0,
        "layer": "layers.0.self_attn",
    },
    "style": "NxDI Mistral: NeuronAttentionBase qkv_proj(q/k/v_proj) / o_proj(o_proj), GQA 4/2, rotate_half 1e4, "
    "sliding_window 3, KVCacheManager past_key_values buffers, token-gen prior/active manual_softmax; the "
    "token-gen prior mask ignores the window (step 0 for prompts >= 3)",
}

MAX_BATCH = 4
MAX_LEN = 64


class RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, base):
        super().__init__()
        self.dim = dim
        self.base = base

    def forward(self, x, position_ids):
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2, dtype=torch.float64) / self.dim))
        freqs = position_ids.to(torch.float64)[..., None] * inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    cos, sin = cos[:, None], sin[:, None]
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def repeat_kv(x, n_rep):
    b, kv, s, d = x.shape
    if n_rep == 1:
        return x
    return x[:, :, None].expand(b, kv, n_rep, s, d).reshape(b, kv * n_rep, s, d)


def manual_softmax(prior_scores, active_scores):
    max_score = torch.maximum(prior_scores.max(dim=-1, keepdim=True).values, active_scores.max(dim=-1, keepdim=True).values)
    prior_exp = torch.exp(prior_scores - max_score)
    active_exp = torch.exp(active_scores - max_score)
    denom = prior_exp.sum(-1, keepdim=True) + active_exp.sum(-1, keepdim=True)
    return prior_exp / denom, active_exp / denom


class GroupQueryAttention_QKV(nn.Module):
    def __init__(self, hidden, heads, kv_heads, head_dim):
        super().__init__()
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)

    def forward(self, hidden_states):
        return self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)


class GroupQueryAttention_O(nn.Module):
    def __init__(self, heads, head_dim, hidden):
        super().__init__()
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    def forward(self, x):
        return self.o_proj(x)


class NeuronMistralAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.sliding_window = config.sliding_window
        self.qkv_proj = GroupQueryAttention_QKV(config.hidden_size, self.num_heads, self.num_key_value_heads, self.head_dim)
        self.o_proj = GroupQueryAttention_O(self.num_heads, self.head_dim, config.hidden_size)
        self.rotary_emb = RotaryEmbedding(self.head_dim, config.rope_theta)

    def move_heads_front(self, x, b, s, h):
        return x.view(b, s, h, self.head_dim).transpose(1, 2)

    def attention_context_encode(self, Q, K, V, position_ids):
        K_active = repeat_kv(K, self.num_key_value_groups)
        V_active = repeat_kv(V, self.num_key_value_groups)
        scores = torch.matmul(Q, K_active.transpose(2, 3)) / math.sqrt(self.head_dim)
        pos = position_ids[0]
        dist = pos[:, None] - pos[None, :]
        mask = (dist >= 0) & (dist < self.sliding_window)
        scores = scores.masked_fill(~mask[None, None], torch.finfo(scores.dtype).min)
        probs = F.softmax(scores, dim=-1)
        return torch.matmul(probs, V_active)

    def attention_tokengen(self, Q, K, V, position_ids, past_key_value):
        K_prior, V_prior = past_key_value
        b = Q.shape[0]
        K_prior = repeat_kv(K_prior[:b], self.num_key_value_groups)
        V_prior = repeat_kv(V_prior[:b], self.num_key_value_groups)
        prior_scores = torch.matmul(Q, K_prior.transpose(2, 3)) / math.sqrt(self.head_dim)
        # generic token-gen mask: every key already written is visible
        attention_mask = position_ids[:, :, None] > torch.arange(K_prior.shape[2], device=Q.device)[None, None, :]
        prior_scores = prior_scores.masked_fill(~attention_mask[:, None], torch.finfo(prior_scores.dtype).min)
        K_active = repeat_kv(K, self.num_key_value_groups)
        V_active = repeat_kv(V, self.num_key_value_groups)
        active_scores = torch.matmul(Q, K_active.transpose(2, 3)) / math.sqrt(self.head_dim)
        prior_probs, active_probs = manual_softmax(prior_scores, active_scores)
        return torch.matmul(prior_probs, V_prior) + torch.matmul(active_probs, V_active)

    def forward(self, hidden_states, position_ids, past_key_value=None, token_gen=False):
        b, s, _ = hidden_states.shape
        Q, K, V = self.qkv_proj(hidden_states)
        Q = self.move_heads_front(Q, b, s, self.num_heads)
        K = self.move_heads_front(K, b, s, self.num_key_value_heads)
        V = self.move_heads_front(V, b, s, self.num_key_value_heads)
        cos, sin = self.rotary_emb(V, position_ids)
        Q, K = apply_rotary_pos_emb(Q, K, cos, sin)
        if token_gen:
            attn_output = self.attention_tokengen(Q, K, V, position_ids, past_key_value)
        else:
            attn_output = self.attention_context_encode(Q, K, V, position_ids)
        attn_output = attn_output.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim)
        return self.o_proj(attn_output), (K, V)


class KVCacheManager(nn.Module):
    def __init__(self, config):
        super().__init__()
        head_dim = config.hidden_size // config.num_attention_heads
        shape = (MAX_BATCH, config.num_key_value_heads, MAX_LEN, head_dim)
        self.past_key_values = nn.ParameterList(
            [nn.Parameter(torch.zeros(shape), requires_grad=False) for _ in range(2 * config.num_hidden_layers)]
        )

    def get_kv_by_layer_id(self, idx):
        return self.past_key_values[2 * idx], self.past_key_values[2 * idx + 1]

    def update_cache(self, idx, position_ids, k, v):
        with torch.no_grad():
            b = k.shape[0]
            pos = position_ids[0]
            self.past_key_values[2 * idx].data[:b, :, pos] = k.to(self.past_key_values[2 * idx].dtype)
            self.past_key_values[2 * idx + 1].data[:b, :, pos] = v.to(self.past_key_values[2 * idx].dtype)

    def reset(self):
        for p in self.past_key_values:
            p.data.zero_()


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class NeuronMistralDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = NeuronMistralAttention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states, position_ids, past_key_value=None, token_gen=False):
        attn_out, present = self.self_attn(self.input_layernorm(hidden_states), position_ids, past_key_value, token_gen)
        h = hidden_states + attn_out
        return h + self.mlp(self.post_attention_layernorm(h)), present


class NeuronMistralModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([NeuronMistralDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.kv_mgr = KVCacheManager(config)
        self.seq_len = 0

    def reset_kv_cache(self):
        self.kv_mgr.reset()
        self.seq_len = 0

    def forward(self, input_ids, use_cache=False):
        b, s = input_ids.shape
        start = self.seq_len if use_cache else 0
        position_ids = torch.arange(start, start + s, device=input_ids.device)[None].expand(b, -1)
        token_gen = use_cache and start > 0
        h = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            past = self.kv_mgr.get_kv_by_layer_id(i) if token_gen else None
            h, (k, v) = layer(h, position_ids, past, token_gen)
            if use_cache:
                self.kv_mgr.update_cache(i, position_ids, k, v)
        if use_cache:
            self.seq_len = start + s
        return self.lm_head(self.norm(h))


def make_model():
    torch.manual_seed(2212)
    config = SimpleNamespace(
        vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, rope_theta=10000.0, rms_norm_eps=1e-5, sliding_window=3,
    )
    model = NeuronMistralModel(config)
    g = torch.Generator().manual_seed(22121)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

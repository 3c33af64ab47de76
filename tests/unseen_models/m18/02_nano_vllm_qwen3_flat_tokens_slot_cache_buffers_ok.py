"""nano-vllm (GeeeekExplorer/nano-vllm) Qwen3 in plain torch, without its Triton/flash-attn kernels.

Qwen3ForCausalLM: model (Qwen3Model: embed_tokens, layers.N, norm) and lm_head.  Hidden states are
flattened to (num_tokens, hidden) with a `positions` vector, as in nano-vllm's engine.  RMSNorm has the
fused residual form (`norm(x, residual)` returns (normed, x + residual)).  Qwen3Attention: one
`qkv_proj` (QKVParallelLinear, no bias) split by (q_size, kv_size, kv_size), per-head `q_norm` /
`k_norm` RMSNorm(head_dim) before `rotary_emb` (get_rope: neox halves from a float64 cos/sin cache,
base 1e6), then an inner `attn` (the Attention module that owns `k_cache` / `v_cache` and is handed
q/k/v), `o_proj`.  GQA 4/2, head 16.  Qwen3MLP: merged `gate_up_proj`, SiluAndMul, `down_proj`.
The kv cache is slot-addressed like nano-vllm's block tables: each sequence owns a run of slots
(seq * max_model_len + position), `store_kvcache` writes k/v at `slot_mapping`, prefill attends over
the new tokens (varlen causal), decode reads the cached context of `context_lens` keys.
Cache: book-buffers: `model.reset_kv_cache()`, `model(prompt, use_cache=True)`,
`model(tok, use_cache=True)` (batch <= 4, 64 positions).  `model(ids)` touches no cache.  Returns the
logits tensor (batch, tokens, vocab).  Correct.
"""

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
    "cache": "book-buffers",
    "style": "nano-vllm qwen3.py: flat (num_tokens, hidden) + positions, fused-residual RMSNorm, qkv_proj split, "
    "per-head q_norm/k_norm before neox rope from a cos_sin_cache (base 1e6), GQA 4/2, inner Attention owning "
    "slot-addressed k_cache/v_cache (store_kvcache at slot_mapping, prefill varlen / decode context_lens)",
}


class _Context:
    def __init__(self):
        self.reset()

    def reset(self, is_prefill=False, cu_seqlens=None, slot_mapping=None, context_lens=None, starts=None):
        self.is_prefill = is_prefill
        self.cu_seqlens = cu_seqlens
        self.slot_mapping = slot_mapping
        self.context_lens = context_lens
        self.starts = starts


_CONTEXT = _Context()


def get_context():
    return _CONTEXT


class RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def rms_forward(self, x):
        orig_dtype = x.dtype
        x = x.float() if orig_dtype != torch.float64 else x
        var = x.pow(2).mean(dim=-1, keepdim=True)
        x = x * torch.rsqrt(var + self.eps)
        return x.to(orig_dtype) * self.weight

    def add_rms_forward(self, x, residual):
        x = x + residual
        residual = x
        return self.rms_forward(x), residual

    def forward(self, x, residual=None):
        if residual is None:
            return self.rms_forward(x)
        return self.add_rms_forward(x, residual)


def apply_rotary_emb(x, cos, sin):
    x1, x2 = torch.chunk(x, 2, dim=-1)
    y1 = x1 * cos - x2 * sin
    y2 = x2 * cos + x1 * sin
    return torch.cat((y1, y2), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_size, rotary_dim, max_position_embeddings, base):
        super().__init__()
        self.head_size = head_size
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
        t = torch.arange(max_position_embeddings, dtype=torch.float64)
        freqs = torch.einsum("i,j -> ij", t, inv_freq)
        self.register_buffer("cos_sin_cache", torch.cat((freqs.cos(), freqs.sin()), dim=-1), persistent=False)

    def forward(self, positions, query, key):
        cos_sin = self.cos_sin_cache[positions]
        cos, sin = cos_sin.chunk(2, dim=-1)
        cos = cos.unsqueeze(-2).to(query.dtype)
        sin = sin.unsqueeze(-2).to(query.dtype)
        return apply_rotary_emb(query, cos, sin), apply_rotary_emb(key, cos, sin)


def store_kvcache(key, value, k_cache, v_cache, slot_mapping):
    k_cache[slot_mapping] = key.to(k_cache.dtype)
    v_cache[slot_mapping] = value.to(v_cache.dtype)


def _attend(q, k, v, scale, causal_offset):
    # q (s_q, h, d), k/v (s_k, kv, d)
    group = q.size(1) // k.size(1)
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    s_q, s_k = q.size(0), k.size(0)
    qpos = torch.arange(s_q, device=q.device)[:, None] + causal_offset
    kpos = torch.arange(s_k, device=q.device)[None, :]
    scores = scores.masked_fill(kpos > qpos, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


class Attention(nn.Module):
    def __init__(self, num_heads, head_dim, scale, num_kv_heads):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.k_cache = self.v_cache = torch.tensor([])

    def forward(self, q, k, v):
        context = get_context()
        k_cache, v_cache = self.k_cache, self.v_cache
        if context.slot_mapping is not None and k_cache.numel():
            store_kvcache(k, v, k_cache, v_cache, context.slot_mapping)
        outs = []
        cu = context.cu_seqlens
        for i in range(len(cu) - 1):
            qi = q[cu[i] : cu[i + 1]]
            if context.is_prefill or context.slot_mapping is None:
                ki, vi = k[cu[i] : cu[i + 1]], v[cu[i] : cu[i + 1]]
                offset = 0
            else:
                base = context.starts[i]
                n = context.context_lens[i]
                ki = k_cache[base : base + n].to(q.dtype)
                vi = v_cache[base : base + n].to(q.dtype)
                offset = n - qi.size(0)
            outs.append(_attend(qi, ki, vi, self.scale, offset))
        return torch.cat(outs, dim=0)


class Qwen3Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.total_num_heads = config.num_attention_heads
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scaling = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.rotary_emb = RotaryEmbedding(
            self.head_dim, self.head_dim, config.max_position_embeddings, config.rope_theta
        )
        self.attn = Attention(self.num_heads, self.head_dim, self.scaling, self.num_kv_heads)
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, positions, hidden_states):
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.view(-1, self.num_heads, self.head_dim))
        k = self.k_norm(k.view(-1, self.num_kv_heads, self.head_dim))
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        o = self.attn(q, k, v)
        return self.o_proj(o.flatten(1, -1))


class Qwen3MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        x, y = self.gate_up_proj(x).chunk(2, -1)
        return self.down_proj(F.silu(x) * y)


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = Qwen3Attention(config)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions, hidden_states, residual):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class Qwen3Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([Qwen3DecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids, positions):
        hidden_states = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class Qwen3ForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = Qwen3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.max_num_seqs = 4
        self.max_model_len = 64
        self._num_cached = 0

    def reset_kv_cache(self):
        self._num_cached = 0
        for layer in self.model.layers:
            attn = layer.self_attn.attn
            attn.k_cache = attn.v_cache = torch.tensor([])

    def allocate_kv_cache(self):
        # ModelRunner.allocate_kv_cache: one slot per (sequence, position)
        num_slots = self.max_num_seqs * self.max_model_len
        dtype = self.lm_head.weight.dtype
        for layer in self.model.layers:
            attn = layer.self_attn.attn
            attn.k_cache = torch.zeros(num_slots, attn.num_kv_heads, attn.head_dim, dtype=dtype)
            attn.v_cache = torch.zeros(num_slots, attn.num_kv_heads, attn.head_dim, dtype=dtype)

    def forward(self, input_ids, use_cache=False):
        bsz, seq_len = input_ids.shape
        device = input_ids.device
        start = self._num_cached if use_cache else 0
        if use_cache and self.model.layers[0].self_attn.attn.k_cache.numel() == 0:
            self.allocate_kv_cache()
        positions = torch.arange(start, start + seq_len, device=device).repeat(bsz)
        cu_seqlens = [i * seq_len for i in range(bsz + 1)]
        if use_cache:
            starts = [i * self.max_model_len for i in range(bsz)]
            slot_mapping = torch.cat(
                [torch.arange(s + start, s + start + seq_len, device=device) for s in starts]
            )
            get_context().reset(
                is_prefill=(start == 0), cu_seqlens=cu_seqlens, slot_mapping=slot_mapping,
                context_lens=[start + seq_len] * bsz, starts=starts,
            )
            self._num_cached = start + seq_len
        else:
            get_context().reset(is_prefill=True, cu_seqlens=cu_seqlens)
        try:
            hidden = self.model(input_ids.reshape(-1), positions)
        finally:
            get_context().reset()
        return self.lm_head(hidden).view(bsz, seq_len, -1)


def make_model():
    torch.manual_seed(1802)
    config = SimpleNamespace(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=64,
    )
    model = Qwen3ForCausalLM(config)
    g = torch.Generator().manual_seed(18021)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

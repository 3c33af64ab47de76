"""LLaMA with H2O's heavy-hitter KV cache (FMInference/H2O, h2o_hf utils_real_drop/modify_llama.py).

H2O's real-drop attention keeps a per-layer `H2OKVCache_LayerWise(hh_size, recent_size, k_seq_dim=2,
v_seq_dim=2)` on the attention module (`self.kv_cache`).  After the eager attention (fp32 softmax of
`q @ k^T / sqrt(head_dim)` plus a finfo.min causal mask) the layer calls
`past_key_value = self.kv_cache(past_key_value, attn_weights.detach().clone())`: the cache accumulates
each key's attention mass (`_update_hh_score`) and, once the cache is longer than hh_size +
recent_size, keeps the top hh_size heavy hitters plus the recent window.  Here hh_size 4 + recent_size
124 is larger than any sequence used, so nothing is evicted and the model is exact (the budget is in the
config, as `heavy_ratio`/`recent_ratio` would set it).  `_clean_cache()` runs when a prompt starts.
Tree: model.embed_tokens, model.layers.N (input_layernorm, self_attn [q_proj, k_proj, v_proj, o_proj,
rotary_emb, kv_cache], post_attention_layernorm, mlp), model.norm, lm_head.  rotate_half rotary
(base 1e4) by position_ids from the cache's seen-token count, GQA 4/2 via repeat_kv, 3 layers.
Cache: book-cache: `cache = mod.KVCache(n_layers=3)` (`get(i)`, `update(i, (k, v))`, `seq_len()`; an
HF DynamicCache-like holder with a `seen_tokens` counter), `model(prompt, cache=cache)`, `model(tok,
cache=cache)`; `model.reset_kv_cache()` is a no-op.  Returns the logits tensor.
Decode bug: `KVCache.update` stores with `self._entries.setdefault(i, entry)` (written so that the
layer-wise H2O eviction could not be overwritten by a stale entry), so after the prompt no layer's entry
ever changes: the seen-token counter still advances (positions stay right), but every decoded key and
value is dropped.  Step 0 still sees the prompt plus itself; from step 1 on the earlier decoded tokens
are missing.  The prompt pass and the full forward are exact.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,  # the writer had True beside the slip it states; corrected after the first run
    "layers": [
        "model.layers.0.self_attn",
        "model.layers.1.self_attn",
        "model.layers.2.self_attn",
    ],
    "kind": "causal-multihead",
    "cache": "book-cache",
    "decode": {
        "mistake": "cache_stale",
        "step": 1,
        "layer": "model.layers.0.self_attn",
    },
    "style": "H2O real-drop llama: per-attention H2OKVCache_LayerWise(hh_size, recent_size) fed the detached "
    "attention weights (heavy-hitter scores, no eviction within budget), eager fp32 softmax, finfo.min mask, "
    "rotate_half rotary, GQA 4/2 repeat_kv; model-level KVCache with get/update/seq_len; "
    "decode bug: update() uses dict.setdefault, so decoded k/v are never stored",
}


class KVCache:
    def __init__(self, n_layers):
        self.n_layers = n_layers
        self._entries = {}
        self.seen_tokens = 0

    def get(self, i):
        return self._entries.get(i)

    def update(self, i, entry):
        if i == 0:
            self.seen_tokens += entry[0].shape[2] - (
                self._entries[0][0].shape[2] if 0 in self._entries else 0
            )
        self._entries.setdefault(i, entry)

    def seq_len(self):
        return self.seen_tokens


class H2OKVCache_LayerWise:
    def __init__(self, hh_size=4, recent_size=512, k_seq_dim=2, v_seq_dim=2):
        self.hh_size = hh_size
        self.recent_size = recent_size
        self.cache_size = hh_size + recent_size
        self.k_seq_dim = k_seq_dim
        self.v_seq_dim = v_seq_dim
        self.hh_score = None

    def __call__(self, past_key_values, attn_score_cache):
        self._update_hh_score(attn_score_cache)
        if past_key_values is None:
            return None
        seq_len = past_key_values[0].size(self.k_seq_dim)
        if seq_len <= self.cache_size:
            return past_key_values
        bsz, num_heads, _, head_dim = past_key_values[0].shape
        select_hh_scores = self.hh_score[:, : seq_len - self.recent_size]
        _, keep_topk = torch.topk(select_hh_scores, self.hh_size, dim=-1)
        keep_topk = keep_topk.sort().values
        keep_recent = torch.arange(
            seq_len - self.recent_size, seq_len, device=keep_topk.device
        ).repeat(keep_topk.shape[0], 1)
        keep_idx = torch.cat([keep_topk, keep_recent], dim=-1)
        mask = torch.zeros(self.hh_score.shape, dtype=torch.bool, device=past_key_values[0].device)
        mask = mask.scatter(-1, keep_idx, 1)
        k_hh_recent = past_key_values[0][:, mask].view(bsz, num_heads, -1, head_dim)
        v_hh_recent = past_key_values[1][:, mask].view(bsz, num_heads, -1, head_dim)
        self.hh_score = self.hh_score[mask].view(num_heads, self.cache_size)
        return (k_hh_recent, v_hh_recent)

    def _update_hh_score(self, attn_score_cache):
        num_new_tokens = attn_score_cache.shape[2]
        scores = attn_score_cache.sum(0).sum(1)
        if self.hh_score is None:
            self.hh_score = scores
        else:
            old = min(self.hh_score.shape[-1], scores.shape[-1] - num_new_tokens)
            scores[:, :old] += self.hh_score[:, :old]
            self.hh_score = scores

    def _clean_cache(self):
        self.hh_score = None


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
        inv_freq = 1.0 / (
            self.base ** (torch.arange(0, self.dim, 2, dtype=torch.float64) / self.dim)
        )
        freqs = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1).to(x.device)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids):
    cos = cos[position_ids].unsqueeze(1)
    sin = sin[position_ids].unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(
        batch, num_key_value_heads, n_rep, slen, head_dim
    )
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class H2OLlamaAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(
            self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False
        )
        self.v_proj = nn.Linear(
            self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False
        )
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(self.head_dim)
        self.kv_cache = H2OKVCache_LayerWise(
            hh_size=config.hh_size, recent_size=config.recent_size, k_seq_dim=2, v_seq_dim=2
        )

    def _clean_cache(self):
        self.kv_cache._clean_cache()

    def forward(
        self, hidden_states, attention_mask, position_ids, past_key_value=None, use_cache=False
    ):
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

        kv_seq_len = key_states.shape[-2]
        if past_key_value is not None:
            kv_seq_len += past_key_value[0].shape[-2]
        cos, sin = self.rotary_emb(value_states, seq_len=int(position_ids.max()) + 1)
        query_states, key_states = apply_rotary_pos_emb(
            query_states, key_states, cos, sin, position_ids
        )

        if past_key_value is not None:
            key_states = torch.cat([past_key_value[0], key_states], dim=2)
            value_states = torch.cat([past_key_value[1], value_states], dim=2)
        past_key_value = (key_states, value_states) if use_cache else None

        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(
            self.head_dim
        )
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = (
            F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
            if query_states.dtype != torch.float64
            else F.softmax(attn_weights, dim=-1)
        )

        if use_cache:
            past_key_value = self.kv_cache(past_key_value, attn_weights.detach().clone())

        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).contiguous().reshape(bsz, q_len, self.hidden_size)
        return self.o_proj(attn_output), past_key_value


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = H2OLlamaAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self, hidden_states, attention_mask, position_ids, past_key_value=None, use_cache=False
    ):
        residual = hidden_states
        hidden_states, present = self.self_attn(
            self.input_layernorm(hidden_states),
            attention_mask,
            position_ids,
            past_key_value,
            use_cache,
        )
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states)), present


class LlamaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers)]
        )
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids, cache=None):
        bsz, seq_length = input_ids.shape
        past_len = cache.seq_len() if cache is not None else 0
        hidden_states = self.embed_tokens(input_ids)
        dtype = hidden_states.dtype
        position_ids = torch.arange(
            past_len, past_len + seq_length, device=input_ids.device
        ).unsqueeze(0)
        attention_mask = None
        if seq_length > 1:
            mask = torch.full(
                (seq_length, seq_length),
                torch.finfo(dtype).min,
                dtype=dtype,
                device=input_ids.device,
            )
            mask = torch.triu(mask, diagonal=1)
            if past_len > 0:
                mask = torch.cat(
                    [torch.zeros(seq_length, past_len, dtype=dtype, device=input_ids.device), mask],
                    dim=-1,
                )
            attention_mask = mask[None, None]
        for idx, layer in enumerate(self.layers):
            past = None
            if cache is not None:
                past = cache.get(idx)
                if past is None:
                    layer.self_attn._clean_cache()
            hidden_states, present = layer(
                hidden_states, attention_mask, position_ids, past, cache is not None
            )
            if cache is not None:
                cache.update(idx, present)
        return self.norm(hidden_states)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def reset_kv_cache(self):
        pass

    def forward(self, input_ids, cache=None):
        return self.lm_head(self.model(input_ids, cache=cache))


def make_model():
    torch.manual_seed(2411)
    config = SimpleNamespace(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        hh_size=4,
        recent_size=124,
    )
    model = LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(24111)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LlamaRMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

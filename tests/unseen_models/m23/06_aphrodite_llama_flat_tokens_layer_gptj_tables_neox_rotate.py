"""Aphrodite engine's LLaMA (aphrodite-engine aphrodite/modeling/models/llama.py) in plain torch, prefill only.

The engine's layout: `LlamaForCausalLM` = `model` (embed_tokens, layers, norm) + `lm_head`; tokens are
flattened to (num_tokens,) with per-token `positions` and an `AttentionMetadata` holding `seq_lens`, so
each attention sees a 2-D (num_tokens, hidden) input.  `LlamaDecoderLayer`: `input_layernorm` /
`post_attention_layernorm` RMSNorms with the fused residual (`norm(x, residual)` returns the normed
sum and the new residual), `self_attn` = LlamaAttention (`qkv_proj` fused [q | k | v] and split by
q_size / kv_size, `rotary_emb` from get_rope with a (max_position, rotary_dim) `cos_sin_cache`
[cos | sin], `attn` = the backend Attention doing causal attention per sequence with scale
head_dim^-0.5 and kv heads repeat-interleaved, `o_proj`), `mlp` (`gate_up_proj`, SiluAndMul,
`down_proj`).  GQA 4/2, neox (halves) rotary base 1e4, 3 layers.  No cache (the paged KV cache is not
built; `model(ids)` is the prefill).
Slip: layer 1's rotary op was created with `is_neox_style=False` in get_rope's arguments but dispatched
to the neox kernel: its `forward_native` expands the cos/sin halves for the GPT-J (interleaved) layout
(`repeat_interleave(2)`) and then rotates with the neox `rotate_half`, pairing dimension i with i + d/2
under angles laid out for pairs (2i, 2i + 1).  Not a rotation.  Layers 0 and 2 are plain neox.
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
    "cache": None,
    "layer": "model.layers.1.self_attn",
    "stage": "rotated_queries",
    "mistake": "rope_pairing",
    "style": "aphrodite-engine llama.py: flattened (num_tokens, hidden) + positions + AttentionMetadata seq_lens, fused "
    "qkv_proj split by q_size/kv_size, cos_sin_cache [cos|sin], fused-residual RMSNorm, gate_up_proj, GQA 4/2; layer 1 "
    "expands the tables GPT-J style (repeat_interleave) and rotates with the neox rotate_half",
}


class RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x, residual=None):
        if residual is not None:
            x = x + residual
            residual = x
        variance = x.pow(2).mean(dim=-1, keepdim=True)
        out = x * torch.rsqrt(variance + self.variance_epsilon) * self.weight
        return out if residual is None else (out, residual)


def _rotate_neox(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def _apply_rotary_emb(x, cos, sin, is_neox_style):
    cos = cos.unsqueeze(-2)
    sin = sin.unsqueeze(-2)
    if is_neox_style:
        x1, x2 = torch.chunk(x, 2, dim=-1)
    else:
        x1 = x[..., ::2]
        x2 = x[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if is_neox_style:
        return torch.cat((o1, o2), dim=-1)
    return torch.stack((o1, o2), dim=-1).flatten(-2)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_size, rotary_dim, max_position_embeddings, base, is_neox_style, kernel_style=None):
        super().__init__()
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.max_position_embeddings = max_position_embeddings
        self.base = base
        self.is_neox_style = is_neox_style
        self.kernel_style = is_neox_style if kernel_style is None else kernel_style
        self.cos_sin_cache = self._compute_cos_sin_cache()

    def _compute_cos_sin_cache(self):
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float64) / self.rotary_dim))
        t = torch.arange(self.max_position_embeddings, dtype=torch.float64)
        freqs = torch.einsum("i,j -> ij", t, inv_freq)
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1)

    def forward(self, positions, query, key):
        num_tokens = positions.shape[0]
        cos_sin = self.cos_sin_cache[positions].to(query.dtype)
        cos, sin = cos_sin.chunk(2, dim=-1)
        query = query.view(num_tokens, -1, self.head_size)
        key = key.view(num_tokens, -1, self.head_size)
        if self.is_neox_style == self.kernel_style:
            query = _apply_rotary_emb(query, cos, sin, self.is_neox_style)
            key = _apply_rotary_emb(key, cos, sin, self.is_neox_style)
        else:
            # tables prepared for the GPT-J kernel, rotated by the neox one
            cos = cos.repeat_interleave(2, dim=-1).unsqueeze(-2)
            sin = sin.repeat_interleave(2, dim=-1).unsqueeze(-2)
            query = query * cos + _rotate_neox(query) * sin
            key = key * cos + _rotate_neox(key) * sin
        return query.reshape(num_tokens, -1), key.reshape(num_tokens, -1)


def get_rope(head_size, rotary_dim, max_position, base, is_neox_style=True, kernel_style=None):
    return RotaryEmbedding(head_size, rotary_dim, max_position, base, is_neox_style, kernel_style)


class Attention(nn.Module):
    """The backend wrapper: causal attention per sequence of the flattened batch."""

    def __init__(self, num_heads, head_size, scale, num_kv_heads):
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.num_queries_per_kv = num_heads // num_kv_heads

    def forward(self, query, key, value, attn_metadata):
        outputs = []
        start = 0
        for seq_len in attn_metadata.seq_lens:
            end = start + seq_len
            q = query[start:end].view(seq_len, self.num_heads, self.head_size).transpose(0, 1)
            k = key[start:end].view(seq_len, self.num_kv_heads, self.head_size).transpose(0, 1)
            v = value[start:end].view(seq_len, self.num_kv_heads, self.head_size).transpose(0, 1)
            k = k.repeat_interleave(self.num_queries_per_kv, dim=0)
            v = v.repeat_interleave(self.num_queries_per_kv, dim=0)
            attn = torch.matmul(q, k.transpose(-1, -2)) * self.scale
            causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=q.device).tril()
            attn = attn.masked_fill(~causal, float("-inf"))
            attn = torch.softmax(attn, dim=-1)
            out = torch.matmul(attn, v).transpose(0, 1).reshape(seq_len, self.num_heads * self.head_size)
            outputs.append(out)
            start = end
        return torch.cat(outputs, dim=0)


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.total_num_heads = config.num_attention_heads
        self.num_heads = self.total_num_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = self.hidden_size // self.total_num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scaling = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(self.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, self.hidden_size, bias=False)
        is_neox_style = layer_idx not in config.gptj_style_rope_layers
        self.rotary_emb = get_rope(
            self.head_dim, rotary_dim=self.head_dim, max_position=config.max_position_embeddings,
            base=config.rope_theta, is_neox_style=is_neox_style, kernel_style=True,
        )
        self.attn = Attention(self.num_heads, self.head_dim, self.scaling, num_kv_heads=self.num_kv_heads)

    def forward(self, positions, hidden_states, attn_metadata):
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        attn_output = self.attn(q, k, v, attn_metadata)
        return self.o_proj(attn_output)


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        gate_up = self.gate_up_proj(x)
        d = gate_up.shape[-1] // 2
        return self.down_proj(F.silu(gate_up[..., :d]) * gate_up[..., d:])


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions, hidden_states, attn_metadata, residual):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, attn_metadata)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        hidden_states = self.mlp(hidden_states)
        return hidden_states, residual


class LlamaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids, positions, attn_metadata):
        hidden_states = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, attn_metadata, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids):
        b, s = input_ids.shape
        flat_ids = input_ids.reshape(-1)
        positions = torch.arange(s, device=input_ids.device).repeat(b)
        attn_metadata = SimpleNamespace(seq_lens=[s] * b, num_prefills=b)
        hidden_states = self.model(flat_ids, positions, attn_metadata)
        return self.lm_head(hidden_states).view(b, s, -1)


def make_model():
    torch.manual_seed(2306)
    config = SimpleNamespace(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        gptj_style_rope_layers=(1,),
    )
    model = LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(23061)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

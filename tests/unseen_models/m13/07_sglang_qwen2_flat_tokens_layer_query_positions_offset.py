"""SGLang python/sglang/srt/models/qwen2.py, reduced to plain torch (no radix cache, no TP).

Qwen2ForCausalLM: model (Qwen2Model: embed_tokens, layers.N = Qwen2DecoderLayer, norm) and lm_head.
SGLang runs on flattened tokens: hidden_states are (num_tokens, hidden) with a `positions` vector and a
ForwardBatch-like record of sequence lengths.  Qwen2DecoderLayer fuses the residual into the norm call
(`input_layernorm(h, residual)` returns (normed, new_residual)).  Qwen2Attention: fused `qkv_proj`
with bias split by q_size / kv_size, o_proj without bias, GQA 4/2, get_rope neox-style (halves) base 1e6
applied by `rotary_emb(positions, q, k, offsets=None)`, the radix-attention step done per sequence
with a causal mask (extend mode, no prefix).  Mlp: fused `gate_up_proj`, SiluAndMul, down_proj.
Slip: layer 1 passes `offsets=positions` to its rotary embedding (a copy of the chunked-prefill call,
where offsets are the chunk start) and the native rotary applies the offsets to the queries only, so
layer 1's queries are rotated for positions 2*i while the keys are at i.  No cache.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["model.layers.0.self_attn", "model.layers.1.self_attn", "model.layers.2.self_attn"],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "model.layers.1.self_attn",
    "stage": "rotated_queries",
    "mistake": "rope_positions",
    "style": "SGLang qwen2.py: flattened (num_tokens, hidden) tokens + positions, fused residual RMSNorm, qkv_proj "
    "with bias split by sizes, gate_up_proj, get_rope neox; layer 1 rotates queries at positions + offsets",
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
        out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon) * self.weight
        return out if residual is None else (out, residual)


class RotaryEmbedding(nn.Module):
    """get_rope(..., is_neox_style=True) forward_native."""

    def __init__(self, head_size, max_position, base):
        super().__init__()
        self.head_size, self.max_position, self.base = head_size, max_position, base

    def _cos_sin_cache(self):
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.head_size, 2, dtype=torch.float64) / self.head_size))
        freqs = torch.einsum("i,j->ij", torch.arange(self.max_position, dtype=torch.float64), inv_freq)
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1)

    @staticmethod
    def _rotate(x, cos, sin):
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def forward(self, positions, query, key, offsets=None):
        cache = self._cos_sin_cache().to(query.dtype)
        n = positions.shape[0]
        q_pos = positions if offsets is None else positions + offsets
        cos_q, sin_q = cache[q_pos].chunk(2, dim=-1)
        cos_k, sin_k = cache[positions].chunk(2, dim=-1)
        query = self._rotate(query.view(n, -1, self.head_size), cos_q[:, None], sin_q[:, None]).reshape(n, -1)
        key = self._rotate(key.view(n, -1, self.head_size), cos_k[:, None], sin_k[:, None]).reshape(n, -1)
        return query, key


class Qwen2Attention(nn.Module):
    def __init__(self, hidden_size, num_heads, num_kv_heads, layer_id, rope_theta=1000000.0):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = hidden_size // num_heads
        self.q_size = num_heads * self.head_dim
        self.kv_size = num_kv_heads * self.head_dim
        self.scaling = self.head_dim ** -0.5
        self.qkv_proj = nn.Linear(hidden_size, self.q_size + 2 * self.kv_size, bias=True)
        self.o_proj = nn.Linear(self.q_size, hidden_size, bias=False)
        self.rotary_emb = RotaryEmbedding(self.head_dim, 64, rope_theta)
        self.chunked_offsets = layer_id == 1

    def _radix_attention(self, q, k, v, seq_lens):
        outs, start = [], 0
        for L in seq_lens:
            qs = q[start:start + L].view(L, self.num_heads, self.head_dim).transpose(0, 1)
            ks = k[start:start + L].view(L, self.num_kv_heads, self.head_dim).transpose(0, 1)
            vs = v[start:start + L].view(L, self.num_kv_heads, self.head_dim).transpose(0, 1)
            group = self.num_heads // self.num_kv_heads
            ks = ks.repeat_interleave(group, dim=0)
            vs = vs.repeat_interleave(group, dim=0)
            s = (qs @ ks.transpose(-1, -2)) * self.scaling
            causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
            s = s.masked_fill(~causal, float("-inf"))
            o = torch.softmax(s, dim=-1) @ vs
            outs.append(o.transpose(0, 1).reshape(L, self.q_size))
            start += L
        return torch.cat(outs, dim=0)

    def forward(self, positions, hidden_states, seq_lens):
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k, offsets=positions if self.chunked_offsets else None)
        attn_output = self._radix_attention(q, k, v, seq_lens)
        return self.o_proj(attn_output)


class Qwen2MLP(nn.Module):
    def __init__(self, hidden_size, intermediate_size):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Qwen2DecoderLayer(nn.Module):
    def __init__(self, layer_id):
        super().__init__()
        self.self_attn = Qwen2Attention(64, 4, 2, layer_id)
        self.mlp = Qwen2MLP(64, 144)
        self.input_layernorm = RMSNorm(64)
        self.post_attention_layernorm = RMSNorm(64)

    def forward(self, positions, hidden_states, seq_lens, residual):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, seq_lens)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class Qwen2Model(nn.Module):
    def __init__(self, vocab_size=96):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, 64)
        self.layers = nn.ModuleList([Qwen2DecoderLayer(i) for i in range(3)])
        self.norm = RMSNorm(64)

    def forward(self, input_ids, positions, seq_lens):
        hidden_states = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, seq_lens, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class Qwen2ForCausalLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = Qwen2Model()
        self.lm_head = nn.Linear(64, 96, bias=False)

    def forward(self, input_ids):
        bsz, seq_len = input_ids.shape
        flat = input_ids.reshape(-1)
        positions = torch.arange(seq_len, device=input_ids.device).repeat(bsz)
        hidden = self.model(flat, positions, [seq_len] * bsz)
        return self.lm_head(hidden).view(bsz, seq_len, -1)


def make_model():
    torch.manual_seed(1307)
    model = Qwen2ForCausalLM()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(1.0 + 0.2 * torch.randn_like(m.weight))
    return model.eval()

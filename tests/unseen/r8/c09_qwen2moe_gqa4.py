"""Qwen2-MoE style attention inside a small decoder body: q/k/v projections with bias,
o_proj without, GQA 8 query heads over 2 kv heads (groups of 4), rotate_half rotary
with rope_theta 1e6, position_ids derived from cache_position, 4D additive causal mask
built by the model body.
"""

import torch
from torch import nn


class Qwen2MoeRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x):
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.variance_epsilon))


class Qwen2MoeRotaryEmbedding(nn.Module):
    def __init__(self, dim=8, base=1000000.0):
        super().__init__()
        self.register_buffer(
            "inv_freq", 1.0 / (base ** (torch.arange(0, dim, 2).double() / dim)), persistent=False
        )

    @torch.no_grad()
    def forward(self, x, position_ids):
        inv = self.inv_freq[None, :, None].expand(position_ids.shape[0], -1, 1)
        freqs = (inv @ position_ids[:, None, :].double()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def repeat_kv(h, n_rep):
    b, kv, t, d = h.shape
    return h[:, :, None].expand(b, kv, n_rep, t, d).reshape(b, kv * n_rep, t, d)


class Qwen2MoeAttention(nn.Module):
    def __init__(self, hidden_size=64, num_heads=8, num_kv=2):
        super().__init__()
        self.head_dim = hidden_size // num_heads
        self.num_key_value_groups = num_heads // num_kv
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(hidden_size, num_heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(hidden_size, num_kv * self.head_dim, bias=True)
        self.v_proj = nn.Linear(hidden_size, num_kv * self.head_dim, bias=True)
        self.o_proj = nn.Linear(num_heads * self.head_dim, hidden_size, bias=False)

    def forward(self, hidden_states, position_embeddings, attention_mask):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = (q * cos) + (rotate_half(q) * sin)
        k = (k * cos) + (rotate_half(k) * sin)
        k = repeat_kv(k, self.num_key_value_groups)
        v = repeat_kv(v, self.num_key_value_groups)
        w = torch.matmul(q, k.transpose(2, 3)) * self.scaling
        w = w + attention_mask
        w = nn.functional.softmax(w, dim=-1)
        out = torch.matmul(w, v).transpose(1, 2).contiguous()
        return self.o_proj(out.reshape(*input_shape, -1)), w


class Qwen2MoeDecoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = Qwen2MoeAttention()
        self.input_layernorm = Qwen2MoeRMSNorm(64)

    def forward(self, hidden_states, position_embeddings, attention_mask):
        h, _ = self.self_attn(
            self.input_layernorm(hidden_states), position_embeddings, attention_mask
        )
        return hidden_states + h


class Qwen2MoeBody(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Qwen2MoeDecoderLayer()])
        self.norm = Qwen2MoeRMSNorm(64)
        self.rotary_emb = Qwen2MoeRotaryEmbedding()

    def forward(self, inputs_embeds):
        past_seen_tokens = 0
        cache_position = torch.arange(past_seen_tokens, past_seen_tokens + inputs_embeds.shape[1])
        position_ids = cache_position.unsqueeze(0)
        t = inputs_embeds.shape[1]
        mask = torch.full((t, t), torch.finfo(inputs_embeds.dtype).min, dtype=inputs_embeds.dtype)
        mask = torch.triu(mask, diagonal=1)[None, None]
        pe = self.rotary_emb(inputs_embeds, position_ids)
        h = inputs_embeds
        for layer in self.layers:
            h = layer(h, pe, mask)
        return self.norm(h)


def make_body():
    torch.manual_seed(9)
    body = Qwen2MoeBody()
    with torch.no_grad():
        for n in (body.layers[0].input_layernorm, body.norm):
            n.weight.uniform_(0.5, 1.5)
    return body


EXPECT = {
    "target": "make_body",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "layers.0.self_attn",
    "structure": {
        "heads": 8,
        "kv_heads": 2,
        "head_dim": 8,
        "causal": True,
        "cross": False,
        "rope": {"pairing": "half", "fraction": 1.0, "base": 1000000},
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "HF Qwen2-MoE: q/k/v with bias, o_proj without, GQA 8:2 via repeat_kv, rotary from position_ids = "
    "cache_position, additive triu causal mask built by the model body (one layer)",
}

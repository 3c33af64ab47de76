"""Ministral (8B-style) decoder after transformers' modeling_ministral.py (small, random weights, no cache).

MinistralForCausalLM: model (embed_tokens, layers.N, norm, rotary_emb), lm_head.  The config's
`layer_types` alternates "sliding_attention" / "full_attention" (layers 0 and 2 sliding, layer 1
full) with `sliding_window = 6`: a sliding layer's query i sees keys i-5 .. i (6 keys, itself
included), as HF's sliding_window_causal mask does.  MinistralAttention: q/k/v/o without bias,
GQA 4/2, rotate_half rotary (halves) base 1e8, eager matmul * scaling, softmax upcast to at least float32; each layer
takes the additive finfo.min mask of its own type from a dict built once by the model.
Slip: the model builds the sliding mask with a helper `_sliding_window_mask_inclusive` for layers
past the first full layer (ModelArgs.sliding_window read as "keys strictly before the window"), so
layer 2 keeps `i - j <= sliding_window`: 7 keys instead of 6.  Layer 0 gets the right mask.
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
    "layer": "model.layers.2.self_attn",
    "stage": "masked_scores",
    "mistake": "window_size",
    "style": "modeling_ministral.py: layer_types sliding/full/sliding, sliding_window 6, GQA 4/2, rotate_half base 1e8, "
    "per-type mask dict; layer 2's sliding mask keeps i - j <= 6 (7 keys)",
}


class MinistralRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def repeat_kv(x, n_rep):
    b, kv, s, d = x.shape
    return x[:, :, None].expand(b, kv, n_rep, s, d).reshape(b, kv * n_rep, s, d)


class MinistralAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        self.sliding_window = config.sliding_window if self.layer_type == "sliding_attention" else None
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states, position_embeddings, attention_mask):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k = repeat_kv(k, self.num_key_value_groups)
        v = repeat_kv(v, self.num_key_value_groups)
        w = torch.matmul(q, k.transpose(2, 3)) * self.scaling + attention_mask
        w = F.softmax(w, dim=-1, dtype=torch.promote_types(q.dtype, torch.float32)).to(q.dtype)
        out = torch.matmul(w, v).transpose(1, 2).reshape(*input_shape, -1)
        return self.o_proj(out), w


class MinistralMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MinistralDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.attention_type = config.layer_types[layer_idx]
        self.self_attn = MinistralAttention(config, layer_idx)
        self.mlp = MinistralMLP(config)
        self.input_layernorm = MinistralRMSNorm(config.hidden_size)
        self.post_attention_layernorm = MinistralRMSNorm(config.hidden_size)

    def forward(self, hidden_states, attention_mask, position_embeddings):
        h, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states),
                              position_embeddings=position_embeddings, attention_mask=attention_mask)
        hidden_states = hidden_states + h
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


def _additive(allowed, dtype):
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
        ~allowed, torch.finfo(dtype).min)[None, None]


def _causal_mask(t, dtype, device):
    i = torch.arange(t, device=device)
    return _additive(i[None, :] <= i[:, None], dtype)


def _sliding_window_mask(t, window, dtype, device):
    i = torch.arange(t, device=device)
    dist = i[:, None] - i[None, :]
    return _additive((dist >= 0) & (dist < window), dtype)


def _sliding_window_mask_inclusive(t, window, dtype, device):
    i = torch.arange(t, device=device)
    dist = i[:, None] - i[None, :]
    return _additive((dist >= 0) & (dist <= window), dtype)


class MinistralModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([MinistralDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = MinistralRMSNorm(config.hidden_size)
        d = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, input_ids):
        b, t = input_ids.shape
        h = self.embed_tokens(input_ids)
        pos = torch.arange(t, device=h.device, dtype=h.dtype)
        freqs = pos[:, None] * self.inv_freq.to(h.dtype)[None]
        emb = torch.cat((freqs, freqs), dim=-1)[None].expand(b, -1, -1)
        pe = (emb.cos(), emb.sin())
        masks = {
            "full_attention": _causal_mask(t, h.dtype, h.device),
            "sliding_attention": _sliding_window_mask(t, self.config.sliding_window, h.dtype, h.device),
        }
        seen_full = False
        for layer in self.layers:
            if layer.attention_type == "sliding_attention" and seen_full:
                mask = _sliding_window_mask_inclusive(t, self.config.sliding_window, h.dtype, h.device)
            else:
                mask = masks[layer.attention_type]
            seen_full = seen_full or layer.attention_type == "full_attention"
            h = layer(h, mask, pe)
        return self.norm(h)


class MinistralForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = MinistralModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids):
        return SimpleNamespace(logits=self.lm_head(self.model(input_ids)))


def make_model():
    torch.manual_seed(908)
    config = SimpleNamespace(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=1e8,
                             sliding_window=6,
                             layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    model = MinistralForCausalLM(config)
    g = torch.Generator().manual_seed(9081)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, MinistralRMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

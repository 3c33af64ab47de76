"""Hunyuan dense (transformers' modeling_hunyuan_v1_dense.py) with a per-layer attention override.

HunYuanDenseV1ForCausalLM: model (embed_tokens, layers.N, norm, rotary_emb) and lm_head.  Attention:
q/k/v/o without bias, GQA 8/2 (heads of 8, d 64), rotate_half rotary with Hunyuan's dynamic-alpha
base (rope_theta 1e4 * alpha**(d/(d-2)), alpha 2), eager matmul * scaling + finfo.min additive mask,
`use_qk_norm` False in this config.  Layers 0 and 1 use `repeat_kv` (query head h reads kv head
h // 4, the published convention).
Slip: `model.layers.2` was built with `attn_impl="tiled"`, whose KV expansion is
`key_states.repeat(1, n_rep, 1, 1)` (tiling the kv heads), so query head h reads kv head h % 2.
No cache.
"""

from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["model.layers.0.self_attn", "model.layers.1.self_attn", "model.layers.2.self_attn"],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "model.layers.2.self_attn",
    "stage": "scores",
    "mistake": "kv_group_mapping",
    "style": "modeling_hunyuan_v1_dense.py: GQA 8/2, dynamic-alpha rope base, eager finfo.min mask; layer 2's "
    "tiled attention expands kv heads with .repeat(1, n_rep, 1, 1) (h % kv instead of h // group)",
}


class HunYuanRMSNorm(nn.Module):
    def __init__(self, n, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class HunYuanRotaryEmbedding(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        dim = cfg.hidden_size // cfg.num_attention_heads
        base = cfg.rope_theta * cfg.rope_alpha ** (dim / (dim - 2))
        self.register_buffer("inv_freq", 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim),
                             persistent=False)

    def forward(self, x, position_ids):
        f = position_ids[..., None].to(x.dtype) * self.inv_freq.to(x.dtype)
        emb = torch.cat([f, f], -1)
        return emb.cos(), emb.sin()


def repeat_kv(hidden_states, n_rep):
    b, kv, s, d = hidden_states.shape
    return hidden_states[:, :, None].expand(b, kv, n_rep, s, d).reshape(b, kv * n_rep, s, d)


class HunYuanDenseV1Attention(nn.Module):
    def __init__(self, cfg, layer_idx, attn_impl="eager"):
        super().__init__()
        self.layer_idx = layer_idx
        self.attn_impl = attn_impl
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.num_key_value_groups = cfg.num_attention_heads // cfg.num_key_value_heads
        self.scaling = self.head_dim ** -0.5
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_attention_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * self.head_dim, cfg.hidden_size, bias=False)

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
        if self.attn_impl == "tiled":
            k = k.repeat(1, self.num_key_value_groups, 1, 1)
            v = v.repeat(1, self.num_key_value_groups, 1, 1)
        else:
            k = repeat_kv(k, self.num_key_value_groups)
            v = repeat_kv(v, self.num_key_value_groups)
        w = torch.matmul(q, k.transpose(2, 3)) * self.scaling + attention_mask
        w = F.softmax(w, dim=-1)
        o = torch.matmul(w, v).transpose(1, 2).reshape(*input_shape, -1)
        return self.o_proj(o), w


class HunYuanDenseV1DecoderLayer(nn.Module):
    def __init__(self, cfg, i):
        super().__init__()
        self.self_attn = HunYuanDenseV1Attention(cfg, i, cfg.layer_attn_impl[i])
        self.input_layernorm = HunYuanRMSNorm(cfg.hidden_size)
        self.post_attention_layernorm = HunYuanRMSNorm(cfg.hidden_size)
        self.mlp = nn.ModuleDict(dict(
            gate_proj=nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False),
            up_proj=nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False),
            down_proj=nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)))

    def forward(self, h, pe, mask):
        a, _ = self.self_attn(hidden_states=self.input_layernorm(h), position_embeddings=pe, attention_mask=mask)
        h = h + a
        x = self.post_attention_layernorm(h)
        return h + self.mlp["down_proj"](F.silu(self.mlp["gate_proj"](x)) * self.mlp["up_proj"](x))


class HunYuanDenseV1Model(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([HunYuanDenseV1DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)])
        self.norm = HunYuanRMSNorm(cfg.hidden_size)
        self.rotary_emb = HunYuanRotaryEmbedding(cfg)

    def forward(self, input_ids):
        b, n = input_ids.shape
        h = self.embed_tokens(input_ids)
        pos = torch.arange(n)[None].expand(b, n)
        mask = torch.full((n, n), torch.finfo(h.dtype).min, dtype=h.dtype).triu(1)[None, None]
        pe = self.rotary_emb(h, pos)
        for layer in self.layers:
            h = layer(h, pe, mask)
        return self.norm(h)


class HunYuanDenseV1ForCausalLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.model = HunYuanDenseV1Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids):
        return SimpleNamespace(logits=self.lm_head(self.model(input_ids)))


def make_model():
    torch.manual_seed(1205)
    cfg = SimpleNamespace(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                          num_attention_heads=8, num_key_value_heads=2, rope_theta=10000.0, rope_alpha=2.0,
                          use_qk_norm=False, layer_attn_impl=["eager", "eager", "tiled"])
    model = HunYuanDenseV1ForCausalLM(cfg)
    g = torch.Generator().manual_seed(12051)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, HunYuanRMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

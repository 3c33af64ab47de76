"""Arcee AFM decoder after transformers' modeling_arcee.py (small, random weights, no cache).

ArceeForCausalLM: model (ArceeModel: embed_tokens, layers.N, norm, rotary_emb), lm_head.
ArceeDecoderLayer: input_layernorm -> self_attn, post_attention_layernorm -> mlp.  ArceeMLP has no
gate: down_proj(relu(up_proj(x)) ** 2).  ArceeAttention: q/k/v/o without bias, GQA 4 query / 2 kv
heads, rotate_half rotary (halves) base 1e4 with yarn-free default init, eager matmul * scaling,
finfo.min additive causal mask, softmax upcast to at least float32.
Slip: layer 1 was switched to a "memory-light" `ArceeTiledKVAttention` which widens keys/values with
`key_states.repeat(1, n_rep, 1, 1)` (tiling the kv heads: 0, 1, 0, 1) instead of `repeat_kv`
(0, 0, 1, 1), so query heads 1 and 2 read the wrong kv head.
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
    "stage": "scores",
    "mistake": "kv_group_mapping",
    "style": "modeling_arcee.py: ReLU^2 up/down MLP, GQA 4/2, rotate_half base 1e4, eager finfo.min mask; layer 1 "
    "tiles kv heads with .repeat(1, n_rep, 1, 1) (query head h -> kv head h % 2 instead of h // 2)",
}


class ArceeRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        var = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(var + self.variance_epsilon))


class ArceeRotaryEmbedding(nn.Module):
    def __init__(self, head_dim, base):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x, position_ids):
        freqs = position_ids[..., None].to(x.dtype) * self.inv_freq.to(x.dtype)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def repeat_kv(hidden_states, n_rep):
    b, kv, s, d = hidden_states.shape
    return hidden_states[:, :, None].expand(b, kv, n_rep, s, d).reshape(b, kv * n_rep, s, d)


class ArceeAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=False)

    def _expand_kv(self, key_states, value_states):
        return repeat_kv(key_states, self.num_key_value_groups), repeat_kv(value_states, self.num_key_value_groups)

    def forward(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        key_states, value_states = self._expand_kv(key_states, value_states)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.scaling
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.promote_types(query_states.dtype, torch.float32)).to(query_states.dtype)
        attn_output = torch.matmul(attn_weights, value_states).transpose(1, 2).reshape(*input_shape, -1)
        return self.o_proj(attn_output), attn_weights


class ArceeTiledKVAttention(ArceeAttention):
    def _expand_kv(self, key_states, value_states):
        n = self.num_key_value_groups
        return key_states.repeat(1, n, 1, 1), value_states.repeat(1, n, 1, 1)


class ArceeMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.relu(self.up_proj(x)) ** 2)


class ArceeDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        attn_cls = ArceeTiledKVAttention if layer_idx in config.tiled_kv_layers else ArceeAttention
        self.self_attn = attn_cls(config, layer_idx)
        self.mlp = ArceeMLP(config)
        self.input_layernorm = ArceeRMSNorm(config.hidden_size)
        self.post_attention_layernorm = ArceeRMSNorm(config.hidden_size)

    def forward(self, hidden_states, attention_mask, position_embeddings):
        residual = hidden_states
        h, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states),
                              position_embeddings=position_embeddings, attention_mask=attention_mask)
        hidden_states = residual + h
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class ArceeModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([ArceeDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = ArceeRMSNorm(config.hidden_size)
        self.rotary_emb = ArceeRotaryEmbedding(config.hidden_size // config.num_attention_heads, config.rope_theta)

    def forward(self, input_ids):
        b, t = input_ids.shape
        h = self.embed_tokens(input_ids)
        position_ids = torch.arange(t, device=input_ids.device)[None].expand(b, -1)
        mask = torch.full((t, t), torch.finfo(h.dtype).min, dtype=h.dtype, device=h.device).triu(1)[None, None]
        pe = self.rotary_emb(h, position_ids)
        for layer in self.layers:
            h = layer(h, mask, pe)
        return self.norm(h)


class ArceeForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = ArceeModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids):
        return SimpleNamespace(logits=self.lm_head(self.model(input_ids)))


def make_model():
    torch.manual_seed(905)
    config = SimpleNamespace(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0,
                             tiled_kv_layers=(1,))
    model = ArceeForCausalLM(config)
    g = torch.Generator().manual_seed(9051)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, ArceeRMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

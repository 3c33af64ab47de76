"""rednote-hilab dots.llm1 after transformers' modeling_dots1.py, small config, eager attention.

Dots1ForCausalLM: model (Dots1Model: embed_tokens, layers.N, norm, rotary_emb) and lm_head.
Dots1DecoderLayer: input_layernorm -> self_attn -> + residual -> post_attention_layernorm -> mlp.
Layers below `first_k_dense_replace` (2) use a dense Dots1MLP; layer 2 uses Dots1MoE (4 routed
experts, top-2 sigmoid router with normalised weights, one shared expert).
Dots1Attention: q_proj/k_proj/v_proj/o_proj without bias, per-head q_norm/k_norm (RMSNorm over
head_dim, applied before the rotary), rotate_half rotary base 1e4, GQA 4/2 via repeat_kv, eager
matmul * scaling, finfo.min additive masks.  `layer_types` comes from use_sliding_window and
max_window_layers = 1: layer 0 full, layers 1 and 2 sliding with `sliding_window` = 4 (a query sees
itself and the 3 keys before it); each attention stores `self.sliding_window`.
Slip: the model's mask mapping gives MoE layers a separate "sliding_attention_moe" mask built for a
flash-attention port's exclusive window convention (`sliding_window - 1`), so layer 2's queries see
only 3 keys (themselves and 2 before).  Layer 1 gets the correct window.
No cache.  Returns an object with `.logits`.
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
    "stage": "masked_scores",
    "mistake": "window_size",
    "style": "modeling_dots1.py: per-head q_norm/k_norm before rope, GQA 4/2, layer_types from max_window_layers "
    "(full, sliding, sliding; window 4), dense MLP then Dots1MoE (sigmoid top-2 + shared expert); the MoE layer's "
    "sliding mask is built with window - 1 (3 keys)",
}


class Dots1RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def repeat_kv(hidden_states, n_rep):
    b, kvh, s, d = hidden_states.shape
    return hidden_states[:, :, None].expand(b, kvh, n_rep, s, d).reshape(b, kvh * n_rep, s, d)


class Dots1RotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        dim = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x, position_ids):
        freqs = position_ids[:, :, None].to(self.inv_freq.dtype) * self.inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class Dots1Attention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=False)
        self.q_norm = Dots1RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Dots1RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.sliding_window = config.sliding_window if config.layer_types[layer_idx] == "sliding_attention" else None

    def forward(self, hidden_states, position_embeddings, attention_mask):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        k = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k = repeat_kv(k, self.num_key_value_groups)
        v = repeat_kv(v, self.num_key_value_groups)
        attn_weights = torch.matmul(q, k.transpose(2, 3)) * self.scaling
        attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.promote_types(attn_weights.dtype, torch.float32)).to(q.dtype)
        attn_output = torch.matmul(attn_weights, v).transpose(1, 2).reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights


class Dots1MLP(nn.Module):
    def __init__(self, config, intermediate_size=None):
        super().__init__()
        inter = intermediate_size or config.intermediate_size
        self.gate_proj = nn.Linear(config.hidden_size, inter, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, inter, bias=False)
        self.down_proj = nn.Linear(inter, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Dots1TopkRouter(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.weight = nn.Parameter(torch.randn(config.n_routed_experts, config.hidden_size) * 0.1)
        self.register_buffer("e_score_correction_bias", torch.zeros(config.n_routed_experts))

    def forward(self, hidden_states):
        scores = F.linear(hidden_states, self.weight).sigmoid()
        topk_weights, topk_indices = torch.topk(scores + self.e_score_correction_bias, k=self.top_k, dim=-1)
        topk_weights = scores.gather(-1, topk_indices)
        topk_weights = topk_weights / (topk_weights.sum(-1, keepdim=True) + 1e-20)
        return topk_indices, topk_weights


class Dots1MoE(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.experts = nn.ModuleList([Dots1MLP(config, config.moe_intermediate_size) for _ in range(config.n_routed_experts)])
        self.gate = Dots1TopkRouter(config)
        self.shared_experts = Dots1MLP(config, config.moe_intermediate_size)

    def forward(self, hidden_states):
        shape = hidden_states.shape
        flat = hidden_states.reshape(-1, shape[-1])
        idx, w = self.gate(flat)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            sel = (idx == e)
            weight = (w * sel.to(w.dtype)).sum(-1, keepdim=True)
            out = out + weight * expert(flat)
        return out.view(shape) + self.shared_experts(hidden_states)


class Dots1DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = Dots1Attention(config, layer_idx)
        self.mlp = Dots1MoE(config) if layer_idx >= config.first_k_dense_replace else Dots1MLP(config)
        self.input_layernorm = Dots1RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = Dots1RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attention_type = config.layer_types[layer_idx]
        if self.attention_type == "sliding_attention" and layer_idx >= config.first_k_dense_replace:
            self.attention_type = "sliding_attention_moe"

    def forward(self, hidden_states, attention_mask, position_embeddings):
        residual = hidden_states
        hidden_states, _ = self.self_attn(self.input_layernorm(hidden_states), position_embeddings, attention_mask)
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


def build_mask(q_len, dtype, device, sliding_window=None):
    q = torch.arange(q_len, device=device)[:, None]
    k = torch.arange(q_len, device=device)[None, :]
    visible = k <= q
    if sliding_window is not None:
        visible = visible & (q - k < sliding_window)
    mask = torch.zeros(q_len, q_len, dtype=dtype, device=device).masked_fill(~visible, torch.finfo(dtype).min)
    return mask[None, None]


class Dots1Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([Dots1DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = Dots1RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = Dots1RotaryEmbedding(config)

    def forward(self, input_ids):
        h = self.embed_tokens(input_ids)
        T = input_ids.shape[1]
        position_ids = torch.arange(T, device=h.device).unsqueeze(0)
        causal_mask_mapping = {
            "full_attention": build_mask(T, h.dtype, h.device),
            "sliding_attention": build_mask(T, h.dtype, h.device, self.config.sliding_window),
            "sliding_attention_moe": build_mask(T, h.dtype, h.device, self.config.sliding_window - 1),
        }
        position_embeddings = self.rotary_emb(h, position_ids)
        for layer in self.layers:
            h = layer(h, causal_mask_mapping[layer.attention_type], position_embeddings)
        return self.norm(h)


class Dots1ForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = Dots1Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids):
        return SimpleNamespace(logits=self.lm_head(self.model(input_ids)))


def make_model():
    torch.manual_seed(0)
    n_layers, max_window_layers = 3, 1
    config = SimpleNamespace(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=48,
                             num_hidden_layers=n_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             rms_norm_eps=1e-6, rope_theta=10000.0, sliding_window=4, use_sliding_window=True,
                             max_window_layers=max_window_layers, first_k_dense_replace=2, n_routed_experts=4,
                             num_experts_per_tok=2)
    config.layer_types = ["sliding_attention" if config.use_sliding_window and i >= max_window_layers
                          else "full_attention" for i in range(n_layers)]
    model = Dots1ForCausalLM(config)
    for m in model.modules():
        if isinstance(m, Dots1RMSNorm):
            nn.init.uniform_(m.weight, 0.6, 1.4)
    return model.eval()

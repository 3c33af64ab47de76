"""Meta Code World Model (CWM), after transformers' modeling_cwm.py (Llama-3 layout with interleaved
local/global attention).

CwmForCausalLM: model (embed_tokens, layers.N, norm, rotary_emb) and lm_head.  CwmDecoderLayer:
input_layernorm -> self_attn -> + residual, post_attention_layernorm -> mlp.  CwmAttention: q/k/v/o_proj
without bias, GQA 4/2 (repeat_kv), rotate_half rope (theta 1e6) from the model-level rotary embedding,
eager matmul * scaling, additive masks picked per layer from `causal_mask_mapping` keyed by the layer's
`attention_type`; `layer_types` = full_attention, sliding_attention, sliding_attention with
`sliding_window` 4 (a query sees itself and the 3 keys before it).  Each attention keeps
`self.sliding_window` = config.sliding_window for sliding layers.
Slip: layer 2's attention was built with the checkpoint's legacy alias `attention_type = "sliding"`
(config.legacy_type_names), which is not a key of the mask mapping; the `.get(..., full causal)` fallback
hands it the full causal mask, so the declared window is never applied.  Layer 1 is right.  No cache.
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
    "mistake": "window_missing",
    "style": "modeling_cwm.py: layer_types full/sliding/sliding (window 4), causal_mask_mapping by attention_type, "
    "GQA 4/2, rope theta 1e6; layer 2's legacy type alias falls back to the full causal mask",
}


class CwmRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class CwmRotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        dim = config.head_dim
        self.register_buffer("inv_freq", 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)),
                             persistent=False)

    def forward(self, x, position_ids):
        freqs = (self.inv_freq.to(torch.float64)[None, :, None] @ position_ids[:, None, :].to(torch.float64)).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def repeat_kv(hidden_states, n_rep):
    b, kvh, s, d = hidden_states.shape
    return hidden_states[:, :, None].expand(b, kvh, n_rep, s, d).reshape(b, kvh * n_rep, s, d)


class CwmAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim ** -0.5
        layer_type = config.layer_types[layer_idx]
        self.attention_type = config.legacy_type_names.get(layer_idx, layer_type)
        self.sliding_window = config.sliding_window if layer_type == "sliding_attention" else None
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
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k = repeat_kv(k, self.num_key_value_groups)
        v = repeat_kv(v, self.num_key_value_groups)
        attn_weights = torch.matmul(q, k.transpose(2, 3)) * self.scaling
        attn_weights = attn_weights + attention_mask[:, :, :, : k.shape[-2]]
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.promote_types(q.dtype, torch.float32)).to(q.dtype)
        attn_output = torch.matmul(attn_weights, v).transpose(1, 2).contiguous()
        return self.o_proj(attn_output.reshape(*input_shape, -1))


class CwmMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class CwmDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = CwmAttention(config, layer_idx)
        self.mlp = CwmMLP(config)
        self.input_layernorm = CwmRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = CwmRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask):
        hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states), position_embeddings, attention_mask)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


def create_causal_mask(n, dtype, window=None):
    q = torch.arange(n)[:, None]
    kv = torch.arange(n)[None, :]
    allowed = kv <= q
    if window is not None:
        allowed = allowed & (q - kv < window)
    mask = torch.zeros(n, n, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


class CwmModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([CwmDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = CwmRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = CwmRotaryEmbedding(config)

    def forward(self, input_ids):
        bsz, n = input_ids.shape
        hidden_states = self.embed_tokens(input_ids)
        position_ids = torch.arange(n, device=input_ids.device)[None].expand(bsz, -1)
        full = create_causal_mask(n, hidden_states.dtype)
        causal_mask_mapping = {
            "full_attention": full,
            "sliding_attention": create_causal_mask(n, hidden_states.dtype, self.config.sliding_window),
        }
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for layer in self.layers:
            mask = causal_mask_mapping.get(layer.self_attn.attention_type, full)
            hidden_states = layer(hidden_states, position_embeddings, mask)
        return self.norm(hidden_states)


class CwmForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = CwmModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids):
        return SimpleNamespace(logits=self.lm_head(self.model(input_ids)))


def make_model():
    torch.manual_seed(1108)
    config = SimpleNamespace(vocab_size=96, hidden_size=64, head_dim=16, intermediate_size=160, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=1000000.0,
                             sliding_window=4, layer_types=["full_attention", "sliding_attention", "sliding_attention"],
                             legacy_type_names={2: "sliding"})
    model = CwmForCausalLM(config)
    g = torch.Generator().manual_seed(11081)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, CwmRMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

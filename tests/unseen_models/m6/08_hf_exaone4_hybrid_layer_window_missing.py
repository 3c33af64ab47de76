"""EXAONE 4.0 in the shape of transformers' modeling_exaone4.py (written from memory, in my own
words; unrelated to m5's EXAONE 3.0 code): `model.embed_tokens`, `model.layers.N` with *no pre-norm*
(post-sublayer `post_attention_layernorm` and `post_feedforward_layernorm`, as in OLMo2), attention
with q/k/v/o_proj (no bias), per-head RMSNorm `q_norm`/`k_norm` applied before the rotary, GQA 4/2
(head_dim 16), rope theta 1e6 with rotate_half (halves).  Hybrid attention from `config.layer_types`:
sliding layers use the rotary and a sliding window of 4 keys (`self.sliding_window`), global layers
use no position encoding at all (NoPE).  The model builds a `causal_mask_mapping` dict of additive
finfo.min masks keyed by layer type and each layer looks up its own.  SwiGLU MLP, `model.norm`,
untied lm_head.  3 layers, vocab 150.  No cache.  Returns an object with `.logits`.

Slip: the config spells layer 2's type "sliding_window" (a legacy name) instead of
"sliding_attention".  The attention module still counts it as sliding (rotary on,
`self.sliding_window = 4`), but the mask lookup falls back to the full causal mask, so the window
is never applied.  `model.layers.2.self_attn`, stage `masked_scores`, `window_missing`.
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
    "layer": "model.layers.2.self_attn",
    "stage": "masked_scores",
    "mistake": "window_missing",
    "style": "modeling_exaone4.py: post-sublayer norms only, per-head q_norm/k_norm, GQA 4/2, sliding layers with rope + window 4, "
    "global NoPE layer, causal_mask_mapping by layer type; slip: layer 2's type string falls back to the full mask",
}


class Exaone4Config:
    vocab_size = 150
    hidden_size = 64
    intermediate_size = 128
    num_hidden_layers = 3
    num_attention_heads = 4
    num_key_value_heads = 2
    head_dim = 16
    rms_norm_eps = 1e-5
    rope_theta = 1000000.0
    sliding_window = 4
    layer_types = ["sliding_attention", "full_attention", "sliding_window"]


class Exaone4RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        h = hidden_states if input_dtype == torch.float64 else hidden_states.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * h.to(input_dtype)


class Exaone4RotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        dim = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x, position_ids):
        freqs = position_ids[:, :, None].double() * self.inv_freq.double()[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def repeat_kv(hidden_states, n_rep):
    b, kvh, s, d = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    return hidden_states[:, :, None].expand(b, kvh, n_rep, s, d).reshape(b, kvh * n_rep, s, d)


def eager_attention_forward(module, query, key, value, attention_mask, scaling):
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask[:, :, :, : key_states.shape[-2]]
    attn_weights = F.softmax(attn_weights, dim=-1)
    attn_output = torch.matmul(attn_weights, value_states)
    return attn_output.transpose(1, 2).contiguous()


class Exaone4Attention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        layer_type = config.layer_types[layer_idx]
        self.attention_type = layer_type
        self.is_sliding = layer_type != "full_attention"
        self.sliding_window = config.sliding_window if self.is_sliding else None
        self.q_proj = nn.Linear(
            config.hidden_size, config.num_attention_heads * self.head_dim, bias=False
        )
        self.k_proj = nn.Linear(
            config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False
        )
        self.v_proj = nn.Linear(
            config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False
        )
        self.o_proj = nn.Linear(
            config.num_attention_heads * self.head_dim, config.hidden_size, bias=False
        )
        self.q_norm = Exaone4RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Exaone4RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        if self.sliding_window is not None:
            cos, sin = position_embeddings
            query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        attn_output = eager_attention_forward(
            self, query_states, key_states, value_states, attention_mask, self.scaling
        )
        return self.o_proj(attn_output.reshape(*input_shape, -1))


class Exaone4MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Exaone4DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.attention_type = config.layer_types[layer_idx]
        self.self_attn = Exaone4Attention(config, layer_idx)
        self.mlp = Exaone4MLP(config)
        self.post_attention_layernorm = Exaone4RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_feedforward_layernorm = Exaone4RMSNorm(
            config.hidden_size, eps=config.rms_norm_eps
        )

    def forward(self, hidden_states, position_embeddings, attention_mask):
        residual = hidden_states
        hidden_states = self.self_attn(hidden_states, position_embeddings, attention_mask)
        hidden_states = residual + self.post_attention_layernorm(hidden_states)
        residual = hidden_states
        hidden_states = self.mlp(hidden_states)
        return residual + self.post_feedforward_layernorm(hidden_states)


def create_causal_mask(q_len, kv_len, dtype, sliding_window=None):
    q_idx = torch.arange(kv_len - q_len, kv_len)[:, None]
    kv_idx = torch.arange(kv_len)[None, :]
    allowed = kv_idx <= q_idx
    if sliding_window is not None:
        allowed = allowed & (kv_idx > q_idx - sliding_window)
    mask = torch.zeros(q_len, kv_len, dtype=dtype)
    mask = mask.masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


class CausalLMOutput:
    def __init__(self, logits):
        self.logits = logits


class Exaone4Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [Exaone4DecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = Exaone4RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Exaone4RotaryEmbedding(config)

    def forward(self, input_ids):
        hidden_states = self.embed_tokens(input_ids)
        seq_len = input_ids.shape[1]
        position_ids = torch.arange(seq_len)[None]
        causal_mask_mapping = {
            "full_attention": create_causal_mask(seq_len, seq_len, hidden_states.dtype),
            "sliding_attention": create_causal_mask(
                seq_len, seq_len, hidden_states.dtype, self.config.sliding_window
            ),
        }
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for layer in self.layers:
            mask = causal_mask_mapping.get(
                layer.attention_type, causal_mask_mapping["full_attention"]
            )
            hidden_states = layer(hidden_states, position_embeddings, mask)
        return self.norm(hidden_states)


class Exaone4ForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = Exaone4Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids):
        return CausalLMOutput(self.lm_head(self.model(input_ids)))


def make_model():
    torch.manual_seed(6108)
    model = Exaone4ForCausalLM(Exaone4Config())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, Exaone4RMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn_like(m.weight))
    return model.eval()

"""A tiny decoder in the style of Hugging Face's Mistral / Qwen2 / Gemma-2 modeling files with
alternating layer types: config.layer_types = ["full_attention", "sliding_attention",
"full_attention"] and config.sliding_window = 4 (a query sees itself and the 3 previous
tokens).  The model builds one additive mask per layer type (causal_mask_mapping) and each
decoder layer picks its own; sliding layers also record self.sliding_window.  GQA 4/2,
rotate_half RoPE, RMSNorm.  Returns an output with .logits.  No cache.

Slip: the sliding mask keeps keys with (q_idx - kv_idx) <= sliding_window, i.e. window + 1
keys per query.  Only layers.1 is a sliding layer; layers 0 and 2 are full causal and right.
"""

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["model.layers.0.self_attn", "model.layers.1.self_attn", "model.layers.2.self_attn"],
    "kind": "causal-multihead",
    "layer": "model.layers.1.self_attn",
    "stage": "masked_scores",
    "mistake": "window_size",
    "cache": None,
    "style": "transformers Mistral/Gemma-2 layer_types + causal_mask_mapping; slip: sliding mask uses "
    "<= sliding_window, so the declared window of 4 keys lets 5 through",
}


@dataclass
class MistralConfig:
    vocab_size: int = 130
    hidden_size: int = 64
    intermediate_size: int = 128
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 128
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    sliding_window: int = 4
    layer_types: list = field(
        default_factory=lambda: ["full_attention", "sliding_attention", "full_attention"]
    )


class RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x):
        var = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype)


class RotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        dim = config.hidden_size // config.num_attention_heads
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x, position_ids):
        freqs = position_ids[:, :, None].float() * self.inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def repeat_kv(x, n_rep):
    b, h, s, d = x.shape
    if n_rep == 1:
        return x
    return x[:, :, None].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


class MistralAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.sliding_window = (
            config.sliding_window if config.layer_types[layer_idx] == "sliding_attention" else None
        )
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

    def forward(self, hidden_states, position_embeddings, attention_mask=None):
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
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(q.dtype)
        attn_output = torch.matmul(attn_weights, v).transpose(1, 2).reshape(*input_shape, -1)
        return self.o_proj(attn_output), attn_weights


class MistralMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MistralDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.attention_type = config.layer_types[layer_idx]
        self.self_attn = MistralAttention(config, layer_idx)
        self.mlp = MistralMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask, position_embeddings):
        residual = hidden_states
        hidden_states, _ = self.self_attn(
            self.input_layernorm(hidden_states), position_embeddings, attention_mask
        )
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


def create_causal_mask(seq_len, dtype):
    q_idx = torch.arange(seq_len)[:, None]
    kv_idx = torch.arange(seq_len)[None, :]
    allowed = kv_idx <= q_idx
    return torch.zeros(seq_len, seq_len, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)[
        None, None
    ]


def create_sliding_window_causal_mask(seq_len, sliding_window, dtype):
    q_idx = torch.arange(seq_len)[:, None]
    kv_idx = torch.arange(seq_len)[None, :]
    allowed = (kv_idx <= q_idx) & ((q_idx - kv_idx) <= sliding_window)
    return torch.zeros(seq_len, seq_len, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)[
        None, None
    ]


@dataclass
class CausalLMOutput:
    logits: torch.Tensor


class MistralModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [MistralDecoderLayer(config, i) for i in range(len(config.layer_types))]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)

    def forward(self, input_ids):
        hidden_states = self.embed_tokens(input_ids)
        seq_len = input_ids.shape[1]
        position_ids = torch.arange(seq_len, device=input_ids.device)[None]
        causal_mask_mapping = {
            "full_attention": create_causal_mask(seq_len, hidden_states.dtype),
            "sliding_attention": create_sliding_window_causal_mask(
                seq_len, self.config.sliding_window, hidden_states.dtype
            ),
        }
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(
                hidden_states,
                causal_mask_mapping[decoder_layer.attention_type],
                position_embeddings,
            )
        return self.norm(hidden_states)


class MistralForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = MistralModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids):
        return CausalLMOutput(logits=self.lm_head(self.model(input_ids)))


def make_model():
    torch.manual_seed(7)
    model = MistralForCausalLM(MistralConfig())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn_like(m.weight))
    return model.eval()

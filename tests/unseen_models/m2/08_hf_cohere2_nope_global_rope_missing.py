"""A tiny Cohere2 (Command R7B) in the style of Hugging Face's modeling_cohere2.py (no cache).

Cohere2ForCausalLM -> model (embed_tokens, layers ModuleList, norm, rotary_emb) + tied
lm_head with logit_scale.  Parallel block: one CohereLayerNorm (mean-centred, weight only)
feeds both attention and MLP.  GQA 6/2, head_dim 8.  Cohere's rotary is interleaved: the
frequencies are repeat_interleave'd and rotate_half works on even/odd pairs.
layer_types = full, sliding, sliding: the full layer has no positional embedding at all
(NoPE) and no window; the sliding layers use rotary and a window of 4.

Slip: apply_rotary_pos_emb computes both rotated tensors but returns the un-rotated key
(`k` instead of `k_embed`).  Only the sliding layers call it, so the global NoPE layer 0 is
right and model.layers.1.self_attn is the first layer whose keys are not rotated while its
queries are.
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
    "cache": None,
    "layer": "model.layers.1.self_attn",
    "stage": "rotated_keys",
    "mistake": "rope_missing",
    "style": "transformers modeling_cohere2.py: NoPE global layer, interleaved rotary on sliding layers, "
    "parallel block, CohereLayerNorm, logit_scale; slip: apply_rotary_pos_emb returns k instead of k_embed",
}


@dataclass
class Cohere2Config:
    vocab_size: int = 128
    hidden_size: int = 48
    intermediate_size: int = 128
    num_hidden_layers: int = 3
    num_attention_heads: int = 6
    num_key_value_heads: int = 2
    layer_norm_eps: float = 1e-5
    rope_theta: float = 50000.0
    sliding_window: int = 4
    logit_scale: float = 0.25
    layer_types: list = field(
        default_factory=lambda: ["full_attention", "sliding_attention", "sliding_attention"]
    )


class CohereLayerNorm(nn.Module):
    def __init__(self, hidden_size=None, eps=1e-5, bias=False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        mean = hidden_states.mean(-1, keepdim=True)
        variance = (hidden_states - mean).pow(2).mean(-1, keepdim=True)
        hidden_states = (hidden_states - mean) * torch.rsqrt(variance + self.variance_epsilon)
        hidden_states = self.weight * hidden_states
        return hidden_states.to(input_dtype)


class Cohere2RotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        dim = config.hidden_size // config.num_attention_heads
        inv_freq = 1.0 / (
            config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
        )
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x, position_ids):
        inv_freq_expanded = (
            self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        )
        freqs = (inv_freq_expanded @ position_ids[:, None, :].float()).transpose(1, 2)
        emb = torch.repeat_interleave(freqs, 2, dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1 = x[..., ::2]
    x2 = x[..., 1::2]
    return torch.stack([-x2, x1], dim=-1).flatten(-2)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    dtype = q.dtype
    q = q.float() if dtype != torch.float64 else q
    k = k.float() if dtype != torch.float64 else k
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed.to(dtype=dtype), k.to(dtype=dtype)


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(
        batch, num_key_value_heads, n_rep, slen, head_dim
    )
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


def eager_attention_forward(module, query, key, value, attention_mask, scaling):
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask[:, :, :, : key_states.shape[-2]]
    attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_output = torch.matmul(attn_weights, value_states)
    return attn_output.transpose(1, 2).contiguous(), attn_weights


class Cohere2Attention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.is_causal = True
        layer_type = config.layer_types[layer_idx]
        self.sliding_window = config.sliding_window if layer_type == "sliding_attention" else None
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

    def forward(self, hidden_states, position_embeddings, attention_mask):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

        cos, sin = position_embeddings
        if self.sliding_window is not None:
            query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        attn_output, attn_weights = eager_attention_forward(
            self, query_states, key_states, value_states, attention_mask, scaling=self.scaling
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights


class Cohere2MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Cohere2DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = Cohere2Attention(config=config, layer_idx=layer_idx)
        self.mlp = Cohere2MLP(config)
        self.input_layernorm = CohereLayerNorm(
            hidden_size=config.hidden_size, eps=config.layer_norm_eps
        )
        self.attention_type = config.layer_types[layer_idx]

    def forward(self, hidden_states, position_embeddings, attention_mask):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states_attention, _ = self.self_attn(
            hidden_states=hidden_states,
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
        )
        hidden_states_mlp = self.mlp(hidden_states)
        return residual + hidden_states_attention + hidden_states_mlp


def make_mask(T, dtype, sliding_window=None):
    q = torch.arange(T)[:, None]
    kv = torch.arange(T)[None, :]
    allowed = kv <= q
    if sliding_window is not None:
        allowed &= kv > q - sliding_window
    return torch.zeros(T, T, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


class Cohere2Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [Cohere2DecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = CohereLayerNorm(hidden_size=config.hidden_size, eps=config.layer_norm_eps)
        self.rotary_emb = Cohere2RotaryEmbedding(config=config)

    def forward(self, input_ids):
        hidden_states = self.embed_tokens(input_ids)
        T = input_ids.shape[1]
        position_ids = torch.arange(T).unsqueeze(0)
        causal_mask_mapping = {
            "full_attention": make_mask(T, hidden_states.dtype),
            "sliding_attention": make_mask(T, hidden_states.dtype, self.config.sliding_window),
        }
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(
                hidden_states,
                position_embeddings=position_embeddings,
                attention_mask=causal_mask_mapping[decoder_layer.attention_type],
            )
        return self.norm(hidden_states)


class Cohere2ForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = Cohere2Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight
        self.logit_scale = config.logit_scale

    def forward(self, input_ids):
        logits = self.lm_head(self.model(input_ids))
        return logits * self.logit_scale


def make_model():
    torch.manual_seed(8808)
    model = Cohere2ForCausalLM(Cohere2Config())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, CohereLayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn_like(m.weight))
    return model.eval()

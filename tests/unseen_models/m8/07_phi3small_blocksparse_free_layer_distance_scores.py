"""Phi-3-small (remote code modeling_phi3_small.py) with the Triton blocksparse kernel removed.

Phi3SmallForCausalLM: model.embed_tokens (x mup_embedding_multiplier), model.layers.N
(Phi3SmallDecoderLayer: input_layernorm (LayerNorm with bias), self_attn, post_attention_layernorm,
mlp = up_proj -> gegelu (interleaved gelu/linear halves, clamped) -> down_proj), model.final_layernorm,
lm_head (logits / mup_width_multiplier).  Phi3SmallSelfAttention: one `query_key_value` Linear (bias)
laid out per kv group as (kv_heads, q_per_kv + 2, head_dim) -> q = [..., :q_per_kv, :], k = [..., -2, :],
v = [..., -1, :]; GQA 4/2; rotary with rotate-half pairing (base 1e6); `dense` output; mup_use_scaling
is False so the scale is 1/sqrt(head_dim).  In the original every other layer
(dense_attention_every_n_layers=2) is a blocksparse layer; here those layers (only layer 1 of 3)
call a pure-torch replacement instead of the kernel.
Slip: the replacement (`_blocksparse_free_scores`) builds its scores as -||q - k||^2 / 2 (the
"distance form", equal to q.k only up to -|q|^2/2 - |k|^2/2; the |k|^2 term is not constant over
keys), then scales, masks and softmaxes as usual.  Not a dot product.  No cache.
"""

import math
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
    "layer": "model.layers.1.self_attn",
    "stage": "scores",
    "mistake": "not_dot_product",
    "style": "Phi-3-small without Triton: per-kv-group fused query_key_value (kv, q_per_kv + 2, hd), GQA 4/2, "
    "rotate-half rotary 1e6, LayerNorm, gegelu, mup embedding/width multipliers; layer 1 (a former blocksparse "
    "layer) uses a pure-torch fallback that scores -||q - k||^2 / 2",
}


def gegelu(input, limit=20.0):
    a_gelu, a_linear = input[..., ::2], input[..., 1::2]
    out_gelu = a_gelu * torch.sigmoid(1.702 * a_gelu.clamp(min=None, max=limit))
    out_linear = a_linear.clamp(min=-limit, max=limit)
    return out_gelu * (out_linear + 1)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, base=10000.0, max_position_embeddings=64):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        t = torch.arange(max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def forward(self, q, k, seqlen_offset=0):
        # q, k: (b, s, h, d)
        s = q.shape[1]
        cos = self.cos_cached[seqlen_offset : seqlen_offset + s][None, :, None, :].to(q.dtype)
        sin = self.sin_cached[seqlen_offset : seqlen_offset + s][None, :, None, :].to(q.dtype)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class Phi3SmallSelfAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_q_per_kv = self.num_heads // self.num_key_value_heads
        self.blocksparse = (layer_idx + 1) % config.dense_attention_every_n_layers == 0
        norm_factor = (
            (self.head_dim / config.mup_attn_multiplier)
            if config.mup_use_scaling
            else math.sqrt(self.head_dim)
        )
        self.softmax_scale = 1.0 / norm_factor
        self.query_key_value = nn.Linear(
            self.hidden_size,
            (self.num_heads + 2 * self.num_key_value_heads) * self.head_dim,
            bias=True,
        )
        self.dense = nn.Linear(self.hidden_size, self.hidden_size, bias=True)
        self.rotary_emb = RotaryEmbedding(self.head_dim, base=config.rope_embedding_base)

    def _dense_scores(self, q, k):
        return torch.einsum("bhqd,bhkd->bhqk", q, k)

    def _blocksparse_free_scores(self, q, k):
        diff = q.unsqueeze(-2) - k.unsqueeze(-3)
        return -0.5 * diff.pow(2).sum(-1)

    def forward(self, hidden_states):
        bsz, q_len, _ = hidden_states.size()
        qkv = self.query_key_value(hidden_states)
        qkv = qkv.view(bsz, q_len, self.num_key_value_heads, self.num_q_per_kv + 2, self.head_dim)
        q = qkv[..., : self.num_q_per_kv, :].reshape(bsz, q_len, self.num_heads, self.head_dim)
        k = qkv[..., -2, :]
        v = qkv[..., -1, :]
        q, k = self.rotary_emb(q, k)
        q = q.transpose(1, 2)
        k = k.transpose(1, 2).repeat_interleave(self.num_q_per_kv, dim=1)
        v = v.transpose(1, 2).repeat_interleave(self.num_q_per_kv, dim=1)
        scores = (
            self._blocksparse_free_scores(q, k) if self.blocksparse else self._dense_scores(q, k)
        )
        scores = scores * self.softmax_scale
        causal = torch.ones(q_len, q_len, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        probs = F.softmax(scores, dim=-1)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(bsz, q_len, self.hidden_size)
        return self.dense(out), None


class Phi3SmallMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.up_proj = nn.Linear(config.hidden_size, 2 * config.ff_intermediate_size)
        self.down_proj = nn.Linear(config.ff_intermediate_size, config.hidden_size)
        self.gegelu_limit = config.gegelu_limit

    def forward(self, x):
        return self.down_proj(gegelu(self.up_proj(x), limit=self.gegelu_limit))


class Phi3SmallDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = Phi3SmallSelfAttention(config, layer_idx)
        self.mlp = Phi3SmallMLP(config)
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.post_attention_layernorm = nn.LayerNorm(
            config.hidden_size, eps=config.layer_norm_epsilon
        )

    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states, _ = self.self_attn(self.input_layernorm(hidden_states))
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class Phi3SmallModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.mup_embedding_multiplier = config.mup_embedding_multiplier
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [Phi3SmallDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.final_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)

    def forward(self, input_ids):
        hidden_states = self.embed_tokens(input_ids) * self.mup_embedding_multiplier
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        return self.final_layernorm(hidden_states)


class Phi3SmallForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = Phi3SmallModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids):
        logits = self.lm_head(self.model(input_ids)) / self.config.mup_width_multiplier
        return SimpleNamespace(logits=logits)


def make_model():
    torch.manual_seed(807)
    config = SimpleNamespace(
        vocab_size=180,
        hidden_size=64,
        ff_intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        layer_norm_epsilon=1e-5,
        rope_embedding_base=1000000.0,
        dense_attention_every_n_layers=2,
        mup_use_scaling=False,
        mup_attn_multiplier=1.0,
        mup_embedding_multiplier=10.0,
        mup_width_multiplier=8.0,
        gegelu_limit=20.0,
    )
    model = Phi3SmallForCausalLM(config)
    g = torch.Generator().manual_seed(8071)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 0.1, generator=g)
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model.eval()

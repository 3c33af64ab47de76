"""Alibaba-NLP "new-impl" modeling.py (the GTE v1.5 / gte-multilingual encoder, NewForMaskedLM).

new (NewModel): embeddings (NewEmbeddings: word_embeddings, token_type_embeddings, LayerNorm, and the
rotary module; no absolute positions), encoder.layer.N (NewLayer, post-norm: attention -> attn_ln,
mlp -> mlp_ln), and lm_head (transform dense + gelu + LayerNorm, decoder).  NewAttention: one
qkv_proj (bias) viewed (b, s, 3, heads, head_dim) and unbound, rotate_half rotary (halves) from
NewRotaryEmbedding base 160000 with the NTK scaling class (dynamic base only past max_position 512,
never reached here), queries/keys/values transposed to (b, h, s, d) and SDPA with the additive padding
bias (all zero for a full mask), o_proj with bias.  NewGatedMLP: up_gate_proj split in up and gate,
gelu(gate) * up, down_proj.  MHA 4x16, bidirectional.
No cache.  `model(ids)` (optionally attention_mask=) returns the MLM logits tensor.
Correct model.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": [
        "new.encoder.layer.0.attention",
        "new.encoder.layer.1.attention",
        "new.encoder.layer.2.attention",
    ],
    "kind": "multihead",
    "cache": None,
    "style": "Alibaba-NLP new-impl (GTE v1.5): NewAttention with one qkv_proj viewed (b, s, 3, h, d) and unbound, "
    "rotate_half rotary base 160000 (NTK class, inactive), SDPA with additive padding bias, o_proj; post-norm "
    "attn_ln/mlp_ln, gated GELU MLP, token types, no absolute positions",
}


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    # q, k: (b, s, h, d); cos, sin: (s, d)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class NewRotaryEmbedding(nn.Module):
    def __init__(self, dim, max_position_embeddings=512, base=10000.0):
        super().__init__()
        self.dim = dim
        self.max_position_embeddings = max_position_embeddings
        self.base = base

    def _tables(self, seq_len, base, dtype):
        inv_freq = 1.0 / (base ** (torch.arange(0, self.dim, 2, dtype=torch.float64) / self.dim))
        t = torch.arange(seq_len, dtype=torch.float64)
        freqs = torch.einsum("i,j->ij", t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, x, seq_len):
        return self._tables(seq_len, self.base, x.dtype)


class NewNTKScalingRotaryEmbedding(NewRotaryEmbedding):
    def __init__(self, dim, max_position_embeddings=512, base=10000.0, scaling_factor=1.0, mixed_b=None):
        super().__init__(dim, max_position_embeddings, base)
        self.scaling_factor = scaling_factor

    def forward(self, x, seq_len):
        base = self.base
        if seq_len > self.max_position_embeddings:
            base = self.base * (
                (self.scaling_factor * seq_len / self.max_position_embeddings) - (self.scaling_factor - 1)
            ) ** (self.dim / (self.dim - 2))
        return self._tables(seq_len, base, x.dtype)


class NewEmbeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        head_dim = config.hidden_size // config.num_attention_heads
        self.rotary_emb = NewNTKScalingRotaryEmbedding(
            head_dim,
            max_position_embeddings=config.max_position_embeddings,
            base=config.rope_theta,
            scaling_factor=config.rope_scaling["factor"],
        )

    def forward(self, input_ids, token_type_ids=None):
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        embeddings = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        embeddings = self.LayerNorm(embeddings)
        rope_embeds = self.rotary_emb(embeddings, seq_len=input_ids.shape[1])
        return embeddings, rope_embeds


class NewAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.qkv_proj = nn.Linear(config.hidden_size, self.all_head_size * 3, bias=True)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=True)

    def forward(self, hidden_states, attention_bias, rope_embeds):
        shape_hd = (self.num_attention_heads, self.attention_head_size)
        qkv_inputs = self.qkv_proj(hidden_states)
        qkv_inputs = qkv_inputs.view(qkv_inputs.shape[:-1] + (3,) + shape_hd)
        query_states, key_states, value_states = qkv_inputs.unbind(dim=-3)
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, *rope_embeds)
        q = query_states.transpose(1, 2)
        k = key_states.transpose(1, 2)
        v = value_states.transpose(1, 2)
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_bias)
        context = context.transpose(1, 2).reshape(hidden_states.shape[0], -1, self.all_head_size)
        return self.o_proj(context)


class NewGatedMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.up_gate_proj = nn.Linear(config.hidden_size, self.intermediate_size * 2, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, config.hidden_size, bias=True)

    def forward(self, hidden_states):
        up_gate = self.up_gate_proj(hidden_states)
        up_states, gate = torch.split(up_gate, self.intermediate_size, dim=-1)
        return self.down_proj(F.gelu(gate) * up_states)


class NewLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention = NewAttention(config)
        self.mlp = NewGatedMLP(config)
        self.attn_ln = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp_ln = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states, attention_bias, rope_embeds):
        residual = hidden_states
        hidden_states = self.attention(hidden_states, attention_bias, rope_embeds)
        hidden_states = self.attn_ln(residual + hidden_states)
        residual = hidden_states
        hidden_states = self.mlp(hidden_states)
        return self.mlp_ln(residual + hidden_states)


class NewEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layer = nn.ModuleList([NewLayer(config) for _ in range(config.num_hidden_layers)])

    def forward(self, hidden_states, attention_bias, rope_embeds):
        for layer_module in self.layer:
            hidden_states = layer_module(hidden_states, attention_bias, rope_embeds)
        return hidden_states


class NewModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embeddings = NewEmbeddings(config)
        self.encoder = NewEncoder(config)

    def forward(self, input_ids, attention_mask=None):
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        embeddings, rope_embeds = self.embeddings(input_ids)
        dtype = embeddings.dtype
        attention_bias = (1.0 - attention_mask[:, None, None, :].to(dtype)) * torch.finfo(dtype).min
        return self.encoder(embeddings, attention_bias, rope_embeds)


class NewLMPredictionHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size)

    def forward(self, hidden_states):
        return self.decoder(self.norm(F.gelu(self.dense(hidden_states))))


class NewForMaskedLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.new = NewModel(config)
        self.lm_head = NewLMPredictionHead(config)

    def forward(self, input_ids, attention_mask=None):
        return self.lm_head(self.new(input_ids, attention_mask=attention_mask))


def make_model():
    torch.manual_seed(1704)
    config = SimpleNamespace(
        vocab_size=96,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=128,
        type_vocab_size=2,
        max_position_embeddings=512,
        layer_norm_eps=1e-12,
        rope_theta=160000.0,
        rope_scaling={"type": "ntk", "factor": 2.0},
        pad_token_id=0,
    )
    model = NewForMaskedLM(config)
    g = torch.Generator().manual_seed(17041)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model.eval()

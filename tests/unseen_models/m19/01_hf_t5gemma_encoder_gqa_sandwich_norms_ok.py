"""T5Gemma encoder used on its own (transformers modeling_t5gemma.py, T5GemmaEncoderModel) with a tied
token head on top.

encoder (T5GemmaEncoder: embed_tokens, normalizer sqrt(hidden) applied to the embeddings, rotary_emb,
layers.N, norm).  T5GemmaEncoderLayer is Gemma-2 style "sandwich": pre_self_attn_layernorm ->
self_attn -> post_self_attn_layernorm -> + residual, then pre_feedforward_layernorm -> gated tanh-GELU
mlp -> post_feedforward_layernorm -> + residual.  Gemma RMSNorm multiplies by (1 + weight).
T5GemmaSelfAttention: q/k/v/o without bias, GQA 4/2 (head_dim 16) via repeat_kv, rotate_half rotary
(base 1e4), scaling = query_pre_attn_scalar ** -0.5 with query_pre_attn_scalar = head_dim, no logit
soft-capping, bidirectional (is_causal False; the padding mask is all zeros here), eager matmul
attention with the softmax in float32 for float32 inputs.  Every layer is a full-attention layer.
No cache (encoder).  Correct.
"""

from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": [
        "encoder.layers.0.self_attn",
        "encoder.layers.1.self_attn",
        "encoder.layers.2.self_attn",
    ],
    "kind": "multihead",
    "cache": None,
    "style": "modeling_t5gemma.py encoder: normalizer sqrt(d), Gemma (1 + w) RMSNorms in sandwich position, "
    "GQA 4/2 repeat_kv, rotate_half base 1e4, query_pre_attn_scalar scaling, bidirectional eager attention",
}


class T5GemmaRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float())
        output = output * (1.0 + self.weight.float())
        return output.type_as(x)


class T5GemmaRotaryEmbedding(nn.Module):
    def __init__(self, head_dim, base=10000.0):
        super().__init__()
        # kept in float64 outside the buffers so that .float()/.double() never rounds the table
        self.inv_freq64 = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))

    def forward(self, x, position_ids):
        freqs = position_ids[:, :, None].to(torch.float64) * self.inv_freq64[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


def eager_attention_forward(module, query, key, value, attention_mask, scaling, softcap=None):
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if softcap is not None:
        attn_weights = torch.tanh(attn_weights / softcap) * softcap
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask[:, :, :, : key_states.shape[-2]]
    attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype) if query.dtype != torch.float64 \
        else F.softmax(attn_weights, dim=-1)
    attn_output = torch.matmul(attn_weights, value_states)
    return attn_output.transpose(1, 2).contiguous(), attn_weights


class T5GemmaSelfAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = config.query_pre_attn_scalar ** -0.5
        self.is_causal = False
        self.attn_logit_softcapping = config.attn_logit_softcapping
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states, position_embeddings, attention_mask=None):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        attn_output, attn_weights = eager_attention_forward(
            self, query_states, key_states, value_states, attention_mask, self.scaling,
            softcap=self.attn_logit_softcapping,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights


class T5GemmaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class T5GemmaEncoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = T5GemmaSelfAttention(config, layer_idx)
        self.pre_self_attn_layernorm = T5GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_self_attn_layernorm = T5GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = T5GemmaMLP(config)
        self.pre_feedforward_layernorm = T5GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_feedforward_layernorm = T5GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask):
        residual = hidden_states
        hidden_states = self.pre_self_attn_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(hidden_states, position_embeddings, attention_mask)
        hidden_states = residual + self.post_self_attn_layernorm(hidden_states)
        residual = hidden_states
        hidden_states = self.mlp(self.pre_feedforward_layernorm(hidden_states))
        return residual + self.post_feedforward_layernorm(hidden_states)


class T5GemmaEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.norm = T5GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = T5GemmaRotaryEmbedding(config.head_dim, config.rope_theta)
        self.layers = nn.ModuleList(
            [T5GemmaEncoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.hidden_size = config.hidden_size

    def forward(self, input_ids, attention_mask=None):
        b, s = input_ids.shape
        inputs_embeds = self.embed_tokens(input_ids)
        position_ids = torch.arange(s, device=input_ids.device).unsqueeze(0).expand(b, -1)
        if attention_mask is None:
            attention_mask = torch.ones(b, s, dtype=torch.long, device=input_ids.device)
        dtype = inputs_embeds.dtype
        bidirectional = (1.0 - attention_mask[:, None, None, :].to(dtype)) * torch.finfo(dtype).min
        hidden_states = inputs_embeds
        normalizer = torch.tensor(self.hidden_size ** 0.5, dtype=dtype)
        hidden_states = hidden_states * normalizer
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_embeddings, bidirectional)
        return self.norm(hidden_states)


class T5GemmaEncoderLM(nn.Module):
    """T5GemmaEncoderModel plus a head tied to the token embeddings (logits over the vocabulary)."""

    def __init__(self, config):
        super().__init__()
        self.encoder = T5GemmaEncoder(config)

    def forward(self, input_ids, attention_mask=None):
        hidden = self.encoder(input_ids, attention_mask)
        return F.linear(hidden, self.encoder.embed_tokens.weight)


def make_model():
    torch.manual_seed(1901)
    config = SimpleNamespace(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
        attn_logit_softcapping=None, rms_norm_eps=1e-6, rope_theta=10000.0, pad_token_id=0,
    )
    model = T5GemmaEncoderLM(config)
    g = torch.Generator().manual_seed(19011)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, T5GemmaRMSNorm):
                m.weight.copy_(0.3 * torch.randn(m.weight.shape, generator=g))
        model.encoder.embed_tokens.weight.mul_(0.5)
    return model.eval()

"""IBM/Princeton Bamba hybrid (transformers' modeling_bamba.py), reduced: attention at layers 1 and 3.

BambaForCausalLM: model (BambaModel: embed_tokens, layers.0..3, final_layernorm, rotary_emb), lm_head.
config.attn_layer_indices = [1, 3]; the other BambaDecoderLayers hold a `mamba` mixer.  Each layer is
pre-norm: input_layernorm -> (mamba | self_attn) -> + residual -> pre_ff_layernorm -> feed_forward
(gate/up/down SiLU) -> + residual.  The Mamba-2 mixer is reduced to its in_proj -> causal depthwise
conv1d -> SiLU, gated by the z half through a gated RMSNorm, -> out_proj (no SSM scan): it carries no
attention and is there only to keep the layer layout.
BambaAttention: q/k/v/o_proj without bias, GQA 4/2 (repeat_kv), rotary on the first
partial_rotary_factor = 0.5 of each head (rotary_emb built for head_dim * 0.5, rotate_half halves on the
rotated part, the rest passed through), rope_theta 1e4, eager matmul * scaling, finfo.min causal mask.
Slip: the config's `attention_variants` gives layer 3 BambaAttentionFused, which unpacks the rotary
call as `q_embed, key_states = apply_rotary_pos_emb(...)` and then attends with the unrotated
`query_states`: its keys are rotated, its queries are not.
No cache.  Returns an object with `.logits`.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": [
        "model.layers.1.self_attn",
        "model.layers.3.self_attn",
    ],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "model.layers.3.self_attn",
    "stage": "rotated_queries",
    "mistake": "rope_missing",
    "style": "modeling_bamba.py hybrid (attention at layers 1, 3; reduced Mamba-2 mixers elsewhere), GQA 4/2, partial "
    "rotary 0.5 with rotate_half, finfo.min mask; layer 3's attention rotates the keys and uses the unrotated queries",
}


class BambaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class BambaRMSNormGated(BambaRMSNorm):
    def forward(self, hidden_states, gate=None):
        if gate is not None:
            hidden_states = hidden_states * F.silu(gate)
        return super().forward(hidden_states)


class BambaRotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        head_dim = config.hidden_size // config.num_attention_heads
        self.dim = int(head_dim * config.partial_rotary_factor)
        self.base = config.rope_theta

    @torch.no_grad()
    def forward(self, x, position_ids):
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2, dtype=torch.float64) / self.dim))
        freqs = position_ids.to(torch.float64)[..., None] * inv_freq.to(x.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    rotary_dim = cos.shape[-1]
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_embed = (q_rot * cos) + (rotate_half(q_rot) * sin)
    k_embed = (k_rot * cos) + (rotate_half(k_rot) * sin)
    return torch.cat([q_embed, q_pass], dim=-1), torch.cat([k_embed, k_pass], dim=-1)


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


def eager_attention_forward(module, query, key, value, attention_mask, scaling):
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask[:, :, :, : key_states.shape[-2]]
    attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.promote_types(query.dtype, torch.float32))
    attn_weights = attn_weights.to(query.dtype)
    attn_output = torch.matmul(attn_weights, value_states).transpose(1, 2).contiguous()
    return attn_output, attn_weights


class BambaAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.is_causal = True
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=False)

    def _rotate(self, query_states, key_states, cos, sin):
        return apply_rotary_pos_emb(query_states, key_states, cos, sin)

    def forward(self, hidden_states, position_embeddings, attention_mask=None):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = self._rotate(query_states, key_states, cos, sin)
        attn_output, attn_weights = eager_attention_forward(
            self, query_states, key_states, value_states, attention_mask, self.scaling
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights


class BambaAttentionFused(BambaAttention):
    def _rotate(self, query_states, key_states, cos, sin):
        q_embed, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        return query_states, key_states


ATTENTION_VARIANTS = {"eager": BambaAttention, "fused": BambaAttentionFused}


class BambaMixer(nn.Module):
    """Reduced Mamba-2 mixer: in_proj -> causal depthwise conv -> SiLU -> gated RMSNorm -> out_proj."""

    def __init__(self, config):
        super().__init__()
        self.intermediate_size = config.mamba_expand * config.hidden_size
        self.conv_kernel_size = config.mamba_d_conv
        self.in_proj = nn.Linear(config.hidden_size, 2 * self.intermediate_size, bias=False)
        self.conv1d = nn.Conv1d(
            self.intermediate_size, self.intermediate_size, kernel_size=self.conv_kernel_size,
            groups=self.intermediate_size, padding=self.conv_kernel_size - 1,
        )
        self.norm = BambaRMSNormGated(self.intermediate_size)
        self.out_proj = nn.Linear(self.intermediate_size, config.hidden_size, bias=False)

    def forward(self, hidden_states):
        seq_len = hidden_states.shape[1]
        projected = self.in_proj(hidden_states)
        gate, x = projected.split([self.intermediate_size, self.intermediate_size], dim=-1)
        x = self.conv1d(x.transpose(1, 2))[..., :seq_len].transpose(1, 2)
        x = F.silu(x)
        return self.out_proj(self.norm(x, gate))


class BambaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class BambaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx, layer_type="mamba"):
        super().__init__()
        self.feed_forward = BambaMLP(config)
        self.input_layernorm = BambaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.pre_ff_layernorm = BambaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layer_type = layer_type
        if layer_type == "mamba":
            self.mamba = BambaMixer(config)
        elif layer_type == "attention":
            variant = config.attention_variants.get(layer_idx, "eager")
            self.self_attn = ATTENTION_VARIANTS[variant](config, layer_idx)

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        if self.layer_type == "mamba":
            hidden_states = self.mamba(hidden_states)
        else:
            hidden_states, _ = self.self_attn(
                hidden_states=hidden_states,
                attention_mask=attention_mask,
                position_embeddings=position_embeddings,
            )
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.feed_forward(self.pre_ff_layernorm(hidden_states))
        return residual + hidden_states


class BambaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [
                BambaDecoderLayer(
                    config, i, layer_type="attention" if i in config.attn_layer_indices else "mamba"
                )
                for i in range(config.num_hidden_layers)
            ]
        )
        self.final_layernorm = BambaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = BambaRotaryEmbedding(config)

    def forward(self, input_ids):
        inputs_embeds = self.embed_tokens(input_ids)
        bsz, seq_len = input_ids.shape
        dtype = inputs_embeds.dtype
        cache_position = torch.arange(seq_len, device=input_ids.device)
        position_ids = cache_position.unsqueeze(0)
        causal_mask = torch.full((seq_len, seq_len), torch.finfo(dtype).min, dtype=dtype, device=input_ids.device)
        causal_mask = torch.triu(causal_mask, diagonal=1)[None, None].expand(bsz, 1, -1, -1)
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        hidden_states = inputs_embeds
        for decoder_layer in self.layers:
            layer_mask = causal_mask if decoder_layer.layer_type == "attention" else None
            hidden_states = decoder_layer(
                hidden_states, attention_mask=layer_mask, position_embeddings=position_embeddings
            )
        return self.final_layernorm(hidden_states)


class BambaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = BambaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids):
        return SimpleNamespace(logits=self.lm_head(self.model(input_ids)))


def make_model():
    torch.manual_seed(1607)
    config = SimpleNamespace(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_layer_indices=[1, 3],
        attention_variants={3: "fused"},
        partial_rotary_factor=0.5,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        mamba_expand=2,
        mamba_d_conv=4,
    )
    model = BambaForCausalLM(config)
    g = torch.Generator().manual_seed(16071)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, BambaRMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

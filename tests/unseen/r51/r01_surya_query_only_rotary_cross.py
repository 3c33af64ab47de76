"""Surya OCR (datalab-to / VikParuchuri) decoder cross-attention onto the image encoder, after the
Qwen2CrossAttention in surya/common/surya/decoder: biased q/k/v projections, bias-free o_proj,
grouped key/value heads (repeat_kv), no mask (every text token sees every image patch), SDPA.
The target block takes (hidden, context) = (text states, encoder embeddings).
This variant follows Surya: apply_rotary_pos_emb(query_states, None, cos, sin) rotates the queries only.

This file: refused: as in Surya's Qwen2CrossAttention, the text queries are rotated by their positions (rotate_half, base 1e4) and the encoder keys are not rotated at all"""

import torch
from torch import nn
import torch.nn.functional as F


class SuryaDecoderConfig:
    hidden_size = 64
    num_attention_heads = 4
    num_key_value_heads = 2
    rope_theta = 10000.0
    rms_norm_eps = 1e-6


class SuryaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(
        batch, num_key_value_heads, n_rep, slen, head_dim
    )
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class SuryaCrossAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(
            config.hidden_size, config.num_attention_heads * self.head_dim, bias=True
        )
        self.k_proj = nn.Linear(
            config.hidden_size, config.num_key_value_heads * self.head_dim, bias=True
        )
        self.v_proj = nn.Linear(
            config.hidden_size, config.num_key_value_heads * self.head_dim, bias=True
        )
        self.o_proj = nn.Linear(
            config.num_attention_heads * self.head_dim, config.hidden_size, bias=False
        )

    def forward(self, hidden_states, position_embeddings=None, **kwargs):
        encoder_hidden_states = kwargs.get("encoder_hidden_states")
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        encoder_hidden_shape = (*encoder_hidden_states.shape[:-1], -1, self.head_dim)

        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(encoder_hidden_states).view(encoder_hidden_shape).transpose(1, 2)
        value_states = self.v_proj(encoder_hidden_states).view(encoder_hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states = (query_states * cos.unsqueeze(1)) + (
            rotate_half(query_states) * sin.unsqueeze(1)
        )
        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)
        attn_output = F.scaled_dot_product_attention(
            query_states, key_states, value_states, scale=self.scaling
        )
        attn_output = attn_output.transpose(1, 2).reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output)


class SuryaCrossBlock(nn.Module):
    """The cross-attention half of a Surya decoder layer: pre-norm, residual."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.cross_attention_layernorm = SuryaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.cross_attn = SuryaCrossAttention(config)

    def forward(self, hidden_states, encoder_embeddings):
        bsz, seq_len, _ = hidden_states.shape
        head_dim = self.config.hidden_size // self.config.num_attention_heads
        inv_freq = 1.0 / (
            self.config.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        )
        freqs = torch.arange(seq_len, dtype=torch.float64)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[None].expand(bsz, -1, -1)
        position_embeddings = (emb.cos().to(hidden_states.dtype), emb.sin().to(hidden_states.dtype))
        residual = hidden_states
        out = self.cross_attn(
            self.cross_attention_layernorm(hidden_states),
            position_embeddings=position_embeddings,
            encoder_hidden_states=encoder_embeddings,
        )
        return residual + out


def make_surya_cross():
    torch.manual_seed(5104)
    model = SuryaCrossBlock(SuryaDecoderConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, SuryaRMSNorm):
                mod.weight.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {
    "target": "make_surya_cross",
    "kind": "cross",
    "ok": True,
    "layer": "cross_attn",
    "unsupported": "query_only_rotary",
    "style": "Surya OCR (datalab-to) decoder cross-attention: refused: as in Surya's "
    "Qwen2CrossAttention, the text queries are rotated by their positions (rotate_half, "
    "base 1e4) and the encoder keys are not rotated at all",
}

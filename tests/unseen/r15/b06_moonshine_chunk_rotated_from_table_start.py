"""HF Moonshine (speech) encoder/decoder attention with memory-efficient query chunking (Rabe & Staats):
queries processed 8 at a time against all keys, each chunk rotated inside the loop from the full
cos/sin tables. Partial rotary (partial_rotary_factor 0.5) with interleaved pairs, bias-free
LayerNorms, decoder with self_attn (causal) and encoder_attn (cross).

This file: one bug: each query chunk rotated with cos[:, :end - start] (positions restart at 0 in every chunk) instead of cos[:, start:end]."""

import torch
import torch.nn.functional as F
from torch import nn


class MoonshineConfig:
    hidden_size = 64
    intermediate_size = 128
    encoder_num_attention_heads = 4
    decoder_num_attention_heads = 4
    partial_rotary_factor = 0.5
    rope_theta = 10000.0
    query_chunk_size = 8  # memory-efficient attention: queries processed 8 at a time


class MoonshineRotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        head_dim = config.hidden_size // config.encoder_num_attention_heads
        dim = int(head_dim * config.partial_rotary_factor)
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x, position_ids):
        freqs = position_ids[:, :, None].to(torch.float64) * self.inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    # interleaved pairs (x0, x1), (x2, x3), ...
    x1 = x[..., 0::2]
    x2 = x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rotary(x, cos, sin):
    """x: (b, h, t, d); cos/sin: (b, t, rot) laid out halves, re-laid as interleaved pairs."""
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)
    sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1)
    rotary_dim = cos.shape[-1]
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    x_embed = (x_rot * cos) + (rotate_half(x_rot) * sin)
    return torch.cat([x_embed, x_pass], dim=-1)


class MoonshineAttention(nn.Module):
    """Moonshine attention with memory-efficient query chunking (Rabe & Staats): each chunk of
    queries sees every key; the chunk's queries are rotated inside the loop from the full tables."""

    def __init__(self, config, num_heads, is_causal, is_cross):
        super().__init__()
        self.config = config
        self.num_heads = num_heads
        self.head_dim = config.hidden_size // num_heads
        self.rotary_ndims = int(self.head_dim * config.partial_rotary_factor)
        self.scaling = self.head_dim**-0.5
        self.is_causal = is_causal
        self.is_cross = is_cross
        self.q_proj = nn.Linear(config.hidden_size, num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, num_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, num_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states, position_embeddings=None, key_value_states=None):
        bsz, q_len, _ = hidden_states.shape
        is_cross_attention = key_value_states is not None
        current_states = key_value_states if is_cross_attention else hidden_states
        kv_len = current_states.shape[1]

        query_states = (
            self.q_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        )
        key_states = (
            self.k_proj(current_states).view(bsz, kv_len, -1, self.head_dim).transpose(1, 2)
        )
        value_states = (
            self.v_proj(current_states).view(bsz, kv_len, -1, self.head_dim).transpose(1, 2)
        )

        if position_embeddings is not None:
            cos, sin = position_embeddings
            key_states = apply_rotary(key_states, cos, sin)

        chunk = self.config.query_chunk_size
        outputs = []
        for start in range(0, q_len, chunk):
            end = min(start + chunk, q_len)
            q_chunk = query_states[:, :, start:end]
            if position_embeddings is not None:
                q_chunk = apply_rotary(q_chunk, cos[:, : end - start], sin[:, : end - start])
            attn_weights = torch.matmul(q_chunk, key_states.transpose(2, 3)) * self.scaling
            if self.is_causal:
                q_pos = torch.arange(start, end, device=hidden_states.device)[:, None]
                k_pos = torch.arange(kv_len, device=hidden_states.device)[None, :]
                attn_weights = attn_weights.masked_fill(k_pos > q_pos, float("-inf"))
            attn_weights = F.softmax(attn_weights, dim=-1)
            outputs.append(torch.matmul(attn_weights, value_states))
        attn_output = torch.cat(outputs, dim=2)

        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, -1).contiguous()
        return self.o_proj(attn_output)


class MoonshineEncoderMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class MoonshineEncoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = MoonshineAttention(
            config, config.encoder_num_attention_heads, is_causal=False, is_cross=False
        )
        self.mlp = MoonshineEncoderMLP(config)
        self.input_layernorm = nn.LayerNorm(config.hidden_size, bias=False)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, bias=False)

    def forward(self, hidden_states, position_embeddings):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = self.self_attn(hidden_states, position_embeddings=position_embeddings)
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class MoonshineDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = MoonshineAttention(
            config, config.decoder_num_attention_heads, is_causal=True, is_cross=False
        )
        self.encoder_attn = MoonshineAttention(
            config, config.decoder_num_attention_heads, is_causal=False, is_cross=True
        )
        self.mlp = MoonshineEncoderMLP(config)
        self.input_layernorm = nn.LayerNorm(config.hidden_size, bias=False)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, bias=False)
        self.final_layernorm = nn.LayerNorm(config.hidden_size, bias=False)

    def forward(self, hidden_states, position_embeddings, encoder_hidden_states=None):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = self.self_attn(hidden_states, position_embeddings=position_embeddings)
        hidden_states = residual + hidden_states
        if encoder_hidden_states is not None:
            residual = hidden_states
            hidden_states = self.post_attention_layernorm(hidden_states)
            hidden_states = self.encoder_attn(hidden_states, key_value_states=encoder_hidden_states)
            hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.final_layernorm(hidden_states))


class MoonshineEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.rotary_emb = MoonshineRotaryEmbedding(config)
        self.layers = nn.ModuleList([MoonshineEncoderLayer(config)])
        self.layer_norm = nn.LayerNorm(config.hidden_size, bias=False)

    def forward(self, inputs_embeds):
        position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device).unsqueeze(
            0
        )
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_embeddings)
        return self.layer_norm(hidden_states)


class MoonshineDecoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.rotary_emb = MoonshineRotaryEmbedding(config)
        self.layers = nn.ModuleList([MoonshineDecoderLayer(config)])
        self.norm = nn.LayerNorm(config.hidden_size, bias=False)

    def forward(self, inputs_embeds, encoder_hidden_states=None):
        position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device).unsqueeze(
            0
        )
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_embeddings, encoder_hidden_states)
        return self.norm(hidden_states)


def _init(model, seed):
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed + 1)
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.copy_(torch.rand(mod.weight.shape, generator=g) + 0.5)
    return model.eval()


def make_moonshine_encoder():
    torch.manual_seed(1514)
    return _init(MoonshineEncoder(MoonshineConfig()), 1514)


def make_moonshine_decoder():
    torch.manual_seed(1514)
    return _init(MoonshineDecoder(MoonshineConfig()), 1514)


EXPECT = {
    "target": "make_moonshine_encoder",
    "kind": "multihead",
    "ok": False,
    "layer": "layers.0.self_attn",
    "stage": "rotated_queries",
    "mistake": "rope_positions",
    "style": "Moonshine chunked-query attention: each query chunk rotated with cos[:, :end - start] (positions"
    " restart at 0 in every chunk) instead of cos[:, start:end]",
}

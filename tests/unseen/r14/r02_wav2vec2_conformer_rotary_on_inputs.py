"""HF Wav2Vec2-Conformer self-attention with rotary position embeddings: the rotation is applied to the
hidden states before linear_q and linear_k (not to the projected queries and keys).

This file: refused."""

import math

import torch
from torch import nn


class Wav2Vec2ConformerConfig:
    hidden_size = 64
    num_attention_heads = 4
    intermediate_size = 128
    rotary_embedding_base = 10000
    position_embeddings_type = "rotary"
    layer_norm_eps = 1e-5
    num_hidden_layers = 1


class Wav2Vec2ConformerRotaryPositionalEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        dim = config.hidden_size // config.num_attention_heads
        base = config.rotary_embedding_base
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, hidden_states):
        sequence_length = hidden_states.shape[1]
        time_stamps = torch.arange(
            sequence_length, dtype=torch.float64, device=hidden_states.device
        )
        freqs = torch.einsum("i,j->ij", time_stamps, self.inv_freq.double())
        embeddings = torch.cat((freqs, freqs), dim=-1)
        cos_embeddings = embeddings.cos()[:, None, None, :]
        sin_embeddings = embeddings.sin()[:, None, None, :]
        return torch.stack([cos_embeddings, sin_embeddings]).to(hidden_states.dtype)


class Wav2Vec2ConformerSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.head_size = config.hidden_size // config.num_attention_heads
        self.num_heads = config.num_attention_heads
        self.position_embeddings_type = config.position_embeddings_type
        self.linear_q = nn.Linear(config.hidden_size, config.hidden_size)
        self.linear_k = nn.Linear(config.hidden_size, config.hidden_size)
        self.linear_v = nn.Linear(config.hidden_size, config.hidden_size)
        self.linear_out = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden_states, attention_mask=None, relative_position_embeddings=None):
        batch_size, sequence_length, hidden_size = hidden_states.size()
        query_key_states = hidden_states
        value_states = hidden_states
        if self.position_embeddings_type == "rotary":
            if relative_position_embeddings is None:
                raise ValueError(
                    "`relative_position_embeddings` has to be defined for rotary embeddings"
                )
            # the rotation is applied to the layer input, before linear_q / linear_k
            query_key_states = self._apply_rotary_embedding(
                query_key_states, relative_position_embeddings
            )

        query = self.linear_q(query_key_states).view(batch_size, -1, self.num_heads, self.head_size)
        key = self.linear_k(query_key_states).view(batch_size, -1, self.num_heads, self.head_size)
        value = self.linear_v(value_states).view(batch_size, -1, self.num_heads, self.head_size)
        query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)

        scores = torch.matmul(query, key.transpose(-2, -1)) / math.sqrt(self.head_size)
        if attention_mask is not None:
            scores = scores + attention_mask
        probs = torch.softmax(scores, dim=-1)
        hidden_states = torch.matmul(probs, value)
        hidden_states = hidden_states.transpose(1, 2).reshape(
            batch_size, -1, self.num_heads * self.head_size
        )
        return self.linear_out(hidden_states), probs

    def _apply_rotary_embedding(self, hidden_states, relative_position_embeddings):
        batch_size, sequence_length, hidden_size = hidden_states.size()
        hidden_states = hidden_states.view(
            batch_size, sequence_length, self.num_heads, self.head_size
        )
        cos = relative_position_embeddings[0, :sequence_length, ...]
        sin = relative_position_embeddings[1, :sequence_length, ...]
        hidden_states = hidden_states.transpose(0, 1)  # (time, batch, heads, head_size)
        rotated_states_begin = hidden_states[..., : self.head_size // 2]
        rotated_states_end = hidden_states[..., self.head_size // 2 :]
        rotated_states = torch.cat(
            (-rotated_states_end, rotated_states_begin), dim=rotated_states_begin.ndim - 1
        )
        hidden_states = (hidden_states * cos) + (rotated_states * sin)
        hidden_states = hidden_states.transpose(0, 1)
        return hidden_states.reshape(batch_size, sequence_length, self.num_heads * self.head_size)


class Wav2Vec2ConformerFeedForward(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.intermediate_dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.intermediate_act_fn = nn.SiLU()
        self.output_dense = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x):
        return self.output_dense(self.intermediate_act_fn(self.intermediate_dense(x)))


class Wav2Vec2ConformerEncoderLayer(nn.Module):
    """Macaron layer without the convolution module: half FFN, self-attention, half FFN, final norm."""

    def __init__(self, config):
        super().__init__()
        self.ffn1_layer_norm = nn.LayerNorm(config.hidden_size)
        self.ffn1 = Wav2Vec2ConformerFeedForward(config)
        self.self_attn_layer_norm = nn.LayerNorm(config.hidden_size)
        self.self_attn = Wav2Vec2ConformerSelfAttention(config)
        self.ffn2_layer_norm = nn.LayerNorm(config.hidden_size)
        self.ffn2 = Wav2Vec2ConformerFeedForward(config)
        self.final_layer_norm = nn.LayerNorm(config.hidden_size)

    def forward(self, hidden_states, attention_mask=None, relative_position_embeddings=None):
        residual = hidden_states
        hidden_states = self.ffn1(self.ffn1_layer_norm(hidden_states))
        hidden_states = hidden_states * 0.5 + residual
        residual = hidden_states
        hidden_states = self.self_attn_layer_norm(hidden_states)
        hidden_states, _ = self.self_attn(
            hidden_states,
            attention_mask=attention_mask,
            relative_position_embeddings=relative_position_embeddings,
        )
        hidden_states = hidden_states + residual
        residual = hidden_states
        hidden_states = self.ffn2(self.ffn2_layer_norm(hidden_states))
        hidden_states = hidden_states * 0.5 + residual
        return self.final_layer_norm(hidden_states)


class Wav2Vec2ConformerEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_positions = Wav2Vec2ConformerRotaryPositionalEmbedding(config)
        self.layers = nn.ModuleList(
            [Wav2Vec2ConformerEncoderLayer(config) for _ in range(config.num_hidden_layers)]
        )
        self.layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states):
        relative_position_embeddings = self.embed_positions(hidden_states)
        for layer in self.layers:
            hidden_states = layer(
                hidden_states, relative_position_embeddings=relative_position_embeddings
            )
        return self.layer_norm(hidden_states)


def make_w2v_conformer_encoder():
    torch.manual_seed(1461)
    model = Wav2Vec2ConformerEncoder(Wav2Vec2ConformerConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.6, 1.4)
                mod.bias.normal_(0.0, 0.1)
    return model.eval()


EXPECT = {
    "target": "make_w2v_conformer_encoder",
    "kind": "multihead",
    "ok": True,
    "layer": "layers.0.self_attn",
    "unsupported": "rotary_before_projection",
    "style": "HF Wav2Vec2ConformerSelfAttention (position_embeddings_type='rotary'): rotate_half applied"
    " per head-sized chunk of the layer input before linear_q/linear_k, so queries and keys are"
    " linear maps of rotated inputs",
}

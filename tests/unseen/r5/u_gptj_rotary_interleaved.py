"""GPT-J-style attention: partial rotary (rotary_dim < head_dim) with interleaved pairs (rotate_every_two), bool tril buffer."""

from types import SimpleNamespace

import torch
from torch import nn


def create_sinusoidal_positions(num_pos, dim):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.int64) / dim))
    sinusoid_inp = torch.einsum(
        "i , j -> i j", torch.arange(num_pos, dtype=torch.int64).float(), inv_freq
    ).float()
    return torch.cat((torch.sin(sinusoid_inp), torch.cos(sinusoid_inp)), dim=1)


def rotate_every_two(x):
    x1 = x[:, :, :, ::2]
    x2 = x[:, :, :, 1::2]
    x = torch.stack((-x2, x1), dim=-1)
    return x.flatten(-2)


def apply_rotary_pos_emb(tensor, sin, cos):
    sin = torch.repeat_interleave(sin[:, :, None, :], 2, 3)
    cos = torch.repeat_interleave(cos[:, :, None, :], 2, 3)
    return (tensor * cos) + (rotate_every_two(tensor) * sin)


class GPTJAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        max_positions = config.max_position_embeddings
        self.register_buffer(
            "bias",
            torch.tril(torch.ones((max_positions, max_positions), dtype=torch.bool)).view(
                1, 1, max_positions, max_positions
            ),
            persistent=False,
        )
        self.embed_dim = config.hidden_size
        self.num_attention_heads = config.num_attention_heads
        self.head_dim = self.embed_dim // self.num_attention_heads
        self.scale_attn = torch.sqrt(torch.tensor(self.head_dim, dtype=torch.float32))
        self.k_proj = nn.Linear(self.embed_dim, self.embed_dim, bias=False)
        self.v_proj = nn.Linear(self.embed_dim, self.embed_dim, bias=False)
        self.q_proj = nn.Linear(self.embed_dim, self.embed_dim, bias=False)
        self.out_proj = nn.Linear(self.embed_dim, self.embed_dim, bias=False)
        self.rotary_dim = config.rotary_dim
        pos_embd_dim = self.rotary_dim or self.embed_dim
        self.register_buffer(
            "embed_positions",
            create_sinusoidal_positions(max_positions, pos_embd_dim),
            persistent=False,
        )

    def _split_heads(self, tensor):
        new_shape = tensor.size()[:-1] + (self.num_attention_heads, self.head_dim)
        return tensor.view(new_shape)  # (batch, seq, head, head_dim)

    def _merge_heads(self, tensor):
        tensor = tensor.permute(0, 2, 1, 3).contiguous()
        return tensor.view(tensor.size()[:-2] + (self.num_attention_heads * self.head_dim,))

    def _attn(self, query, key, value):
        query_length, key_length = query.size(-2), key.size(-2)
        causal_mask = self.bias[:, :, key_length - query_length : key_length, :key_length]
        query = query.to(torch.float32)
        key = key.to(torch.float32)
        attn_weights = torch.matmul(query, key.transpose(-1, -2))
        mask_value = torch.finfo(attn_weights.dtype).min
        attn_weights = torch.where(
            causal_mask, attn_weights, torch.tensor(mask_value, dtype=attn_weights.dtype)
        )
        attn_weights = attn_weights / self.scale_attn
        attn_weights = nn.functional.softmax(attn_weights, dim=-1).to(value.dtype)
        return torch.matmul(attn_weights, value), attn_weights

    def forward(self, hidden_states, position_ids=None):
        bsz, seq_len, _ = hidden_states.shape
        if position_ids is None:
            position_ids = torch.arange(seq_len, device=hidden_states.device)[None].expand(
                bsz, seq_len
            )
        query = self._split_heads(self.q_proj(hidden_states))
        key = self._split_heads(self.k_proj(hidden_states))
        value = self._split_heads(self.v_proj(hidden_states))

        sincos = self.embed_positions[position_ids]
        sin, cos = torch.split(sincos, sincos.shape[-1] // 2, dim=-1)
        if self.rotary_dim is not None:
            k_rot, k_pass = key[:, :, :, : self.rotary_dim], key[:, :, :, self.rotary_dim :]
            q_rot, q_pass = query[:, :, :, : self.rotary_dim], query[:, :, :, self.rotary_dim :]
            key = torch.cat([apply_rotary_pos_emb(k_rot, sin, cos), k_pass], dim=-1)
            query = torch.cat([apply_rotary_pos_emb(q_rot, sin, cos), q_pass], dim=-1)
        else:
            key = apply_rotary_pos_emb(key, sin, cos)
            query = apply_rotary_pos_emb(query, sin, cos)

        key = key.permute(0, 2, 1, 3)
        query = query.permute(0, 2, 1, 3)
        value = value.permute(0, 2, 1, 3)
        attn_output, attn_weights = self._attn(query, key, value)
        return self.out_proj(self._merge_heads(attn_output)), attn_weights


def make_attention():
    config = SimpleNamespace(
        hidden_size=24, num_attention_heads=4, rotary_dim=4, max_position_embeddings=64
    )
    return GPTJAttention(config)


EXPECT = {
    "target": "make_attention",
    "kind": "causal-multihead",
    "unsupported": "rotary",
    "style": "GPT-J attention (rotary_dim=4 of head_dim 6, interleaved rotate_every_two)",
}

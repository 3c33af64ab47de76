"""GPT-NeoX-style attention (per-head [q, k, v] layout); bug: baddbmm is fed key @ query^T, so the score matrix is transposed."""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn


class GPTNeoXAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.hidden_size = config.hidden_size
        self.head_size = self.hidden_size // self.num_attention_heads
        max_positions = config.max_position_embeddings
        self.register_buffer(
            "bias",
            torch.tril(torch.ones((max_positions, max_positions), dtype=torch.bool)).view(
                1, 1, max_positions, max_positions
            ),
            persistent=False,
        )
        self.norm_factor = math.sqrt(self.head_size)
        self.query_key_value = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.attention_dropout = nn.Dropout(config.attention_dropout)

    def forward(self, hidden_states, attention_mask=None, layer_past=None, output_attentions=False):
        qkv = self.query_key_value(hidden_states)
        # [batch, seq, (heads * 3 * head_size)] -> [batch, seq, heads, 3 * head_size]
        new_qkv_shape = qkv.size()[:-1] + (self.num_attention_heads, 3 * self.head_size)
        qkv = qkv.view(*new_qkv_shape)
        query = qkv[..., : self.head_size].permute(0, 2, 1, 3)
        key = qkv[..., self.head_size : 2 * self.head_size].permute(0, 2, 1, 3)
        value = qkv[..., 2 * self.head_size :].permute(0, 2, 1, 3)

        attn_output, attn_weights = self._attn(query, key, value, attention_mask)
        attn_output = self._merge_heads(attn_output)
        attn_output = self.dense(attn_output)
        outputs = (attn_output, layer_past)
        if output_attentions:
            outputs += (attn_weights,)
        return outputs

    def _merge_heads(self, tensor):
        tensor = tensor.permute(0, 2, 1, 3).contiguous()
        return tensor.view(
            tensor.size(0), tensor.size(1), self.num_attention_heads * self.head_size
        )

    def _attn(self, query, key, value, attention_mask=None):
        batch_size, num_heads, query_length, head_size = query.size()
        key_length = key.size(-2)
        causal_mask = self.bias[:, :, key_length - query_length : key_length, :key_length]
        query = query.reshape(batch_size * num_heads, query_length, head_size)
        key = key.reshape(batch_size * num_heads, key_length, head_size)
        attn_scores = torch.zeros(
            batch_size * num_heads, query_length, key_length, dtype=query.dtype, device=key.device
        )
        attn_scores = torch.baddbmm(
            attn_scores, key, query.transpose(1, 2), beta=1.0, alpha=1.0 / self.norm_factor
        )
        attn_scores = attn_scores.view(batch_size, num_heads, query_length, key_length)
        mask_value = torch.finfo(attn_scores.dtype).min
        mask_value = torch.tensor(mask_value, dtype=attn_scores.dtype, device=attn_scores.device)
        attn_scores = torch.where(causal_mask, attn_scores, mask_value)
        if attention_mask is not None:
            attn_scores = attn_scores + attention_mask
        attn_weights = nn.functional.softmax(attn_scores, dim=-1)
        attn_weights = self.attention_dropout(attn_weights)
        attn_output = torch.matmul(attn_weights, value)
        return attn_output, attn_weights


def make_neox_attention():
    config = SimpleNamespace(
        num_attention_heads=4,
        hidden_size=24,
        max_position_embeddings=64,
        attention_dropout=0.0,
    )
    return GPTNeoXAttention(config)


EXPECT = {
    "target": "make_neox_attention",
    "kind": "causal-multihead",
    "ok": False,
    "stage": "scores",
    "mistake": "scores_transposed",
    "style": "GPT-NeoX per-head interleaved query_key_value, baddbmm",
}

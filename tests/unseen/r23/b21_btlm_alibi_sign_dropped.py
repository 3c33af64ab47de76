"""Cerebras BTLM (cerebras/btlm-3b-8k-base remote code, modeling_btlm.py) attention: GPT-2 lineage with a
fused Conv1D c_attn split into query/key/value, _split_heads / _merge_heads, the boolean tril `bias`
buffer applied with torch.where(causal_mask, w, finfo.min), scores divided by head_dim ** 0.5
(mup_scale_qk_dot_by_d off), and ALiBi from the model-level AlibiPositionEmbeddingLayer (slopes from
_get_alibi_slopes, bias = -slope * |j - i|) passed to every layer as position_bias and added after
the causal mask. c_proj on the merged heads. SwiGLU MLP, pre-LayerNorm blocks.

This file: one bug: the negation of the slopes is dropped (alibi = slopes * |j - i|): distant keys get the larger bias."""

import math

import torch
import torch.nn.functional as F
from torch import nn


class BTLMConfig:
    n_embd = 64
    n_head = 8
    n_inner = 128
    n_positions = 128
    layer_norm_epsilon = 1e-5
    position_embedding_type = "alibi"
    mup_scale_qk_dot_by_d = False


class Conv1D(nn.Module):
    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.02 * 5)
        self.bias = nn.Parameter(torch.randn(nf) * 0.02)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


class AlibiPositionEmbeddingLayer(nn.Module):
    def __init__(self, num_heads):
        super().__init__()
        self.num_heads = num_heads
        slopes = torch.tensor(AlibiPositionEmbeddingLayer._get_alibi_slopes(num_heads)).unsqueeze(-1)
        self.slopes = nn.parameter.Parameter(slopes, requires_grad=False)

    def forward(self, seq_length, key_length, cached_qk_len=0):
        context_position = torch.arange(cached_qk_len, cached_qk_len + seq_length, device=self.slopes.device)[:, None]
        memory_position = torch.arange(key_length + cached_qk_len, device=self.slopes.device)[None, :]
        relative_position = memory_position - context_position
        relative_position = torch.abs(relative_position).unsqueeze(0).expand(self.num_heads, -1, -1)
        alibi = self.slopes.unsqueeze(1) * relative_position
        return alibi

    @staticmethod
    def _get_alibi_slopes(n):
        def get_slopes_power_of_2(n):
            start = 2 ** (-(2 ** -(math.log2(n) - 3)))
            ratio = start
            return [start * ratio**i for i in range(n)]

        if math.log2(n).is_integer():
            return get_slopes_power_of_2(n)
        closest_power_of_2 = 2 ** math.floor(math.log2(n))
        return (
            get_slopes_power_of_2(closest_power_of_2)
            + AlibiPositionEmbeddingLayer._get_alibi_slopes(2 * closest_power_of_2)[0::2][: n - closest_power_of_2]
        )


class BTLMAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        max_positions = config.n_positions
        self.register_buffer(
            "bias",
            torch.tril(torch.ones((max_positions, max_positions), dtype=torch.bool)).view(1, 1, max_positions, max_positions),
            persistent=False,
        )
        self.embed_dim = config.n_embd
        self.num_heads = config.n_head
        self.head_dim = self.embed_dim // self.num_heads
        self.split_size = self.embed_dim
        self.c_attn = Conv1D(3 * self.embed_dim, self.embed_dim)
        self.c_proj = Conv1D(self.embed_dim, self.embed_dim)
        self.attn_scale_power = 1.0 if config.mup_scale_qk_dot_by_d else 0.5

    def _attn(self, query, key, value, position_bias=None):
        attn_weights = torch.matmul(query, key.transpose(-1, -2))
        attn_weights = attn_weights / torch.full(
            [], value.size(-1) ** self.attn_scale_power, dtype=attn_weights.dtype, device=attn_weights.device
        )

        query_length, key_length = query.size(-2), key.size(-2)
        causal_mask = self.bias[:, :, key_length - query_length : key_length, :key_length]
        mask_value = torch.finfo(attn_weights.dtype).min
        mask_value = torch.full([], mask_value, dtype=attn_weights.dtype, device=attn_weights.device)
        attn_weights = torch.where(causal_mask, attn_weights, mask_value)

        if position_bias is not None:
            attn_weights = attn_weights + position_bias.type_as(attn_weights).unsqueeze(0)
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        return torch.matmul(attn_weights, value)

    def _split_heads(self, tensor, num_heads, attn_head_size):
        new_shape = tensor.size()[:-1] + (num_heads, attn_head_size)
        tensor = tensor.view(new_shape)
        return tensor.permute(0, 2, 1, 3)

    def _merge_heads(self, tensor, num_heads, attn_head_size):
        tensor = tensor.permute(0, 2, 1, 3).contiguous()
        new_shape = tensor.size()[:-2] + (num_heads * attn_head_size,)
        return tensor.view(new_shape)

    def forward(self, hidden_states, position_bias=None):
        query, key, value = self.c_attn(hidden_states).split(self.split_size, dim=2)
        query = self._split_heads(query, self.num_heads, self.head_dim)
        key = self._split_heads(key, self.num_heads, self.head_dim)
        value = self._split_heads(value, self.num_heads, self.head_dim)
        attn_output = self._attn(query, key, value, position_bias)
        attn_output = self._merge_heads(attn_output, self.num_heads, self.head_dim)
        return self.c_proj(attn_output)


class BTLMMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = Conv1D(config.n_inner, config.n_embd)
        self.c_fc2 = Conv1D(config.n_inner, config.n_embd)
        self.c_proj = Conv1D(config.n_embd, config.n_inner)

    def forward(self, x):
        return self.c_proj(self.c_fc(x) * F.silu(self.c_fc2(x)))


class BTLMBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = BTLMAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = BTLMMLP(config)

    def forward(self, hidden_states, position_bias=None):
        hidden_states = hidden_states + self.attn(self.ln_1(hidden_states), position_bias=position_bias)
        return hidden_states + self.mlp(self.ln_2(hidden_states))


class BTLMModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.h = nn.ModuleList([BTLMBlock(config)])
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.relative_pe = AlibiPositionEmbeddingLayer(config.n_head)

    def forward(self, inputs_embeds):
        seq_len = inputs_embeds.shape[1]
        position_bias = self.relative_pe(seq_len, seq_len, cached_qk_len=0)
        hidden_states = inputs_embeds
        for block in self.h:
            hidden_states = block(hidden_states, position_bias=position_bias)
        return self.ln_f(hidden_states)


def make_btlm():
    torch.manual_seed(2343)
    model = BTLMModel(BTLMConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.3, 0.3)
    return model.eval()


EXPECT = {
    "target": "make_btlm",
    "kind": "causal-multihead",
    "ok": False,
    "layer": "h.0.attn",
    "stage": "biased_scores",
    "mistake": "bias_sign",
    "style": "BTLM AlibiPositionEmbeddingLayer: (self.slopes * -1.0) written as self.slopes",
}

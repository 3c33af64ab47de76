"""A torch port of exllamav2's attention module (turboderp `exllamav2/attn.py`) on its plain-torch
path (`forward_torch`): the module owns its `input_layernorm` and adds the residual itself; linears are
`ExLlamaV2Linear` wrappers; activations are viewed as (batch, q_len, heads, head_dim) for the rope
kernel (`ext_c.rope_` stand-in: neox-style halves, tables from the model's device context, offset by
`past_len`), then transposed; GQA by `repeat_interleave` on the head axis; `matmul`, `*= 1 / sqrt(d)`,
the additive causal mask from `attn_params.get_attn_mask()` (filled with -65504, fp16's lowest),
softmax, `matmul` with the values, `transpose(1, 2).reshape`, `o_proj`. The model (`ExLlamaV2`) builds
the `Params` object and walks its layer list (`self.modules` in exllamav2, renamed `layers` here so it does not shadow nn.Module.modules).

This file: refused (CoPE contextual position encoding: positions counted by sigmoid gates, interpolated learned position logits added to the scores)"""

import math
import torch
from torch import nn


class ExLlamaV2Config:
    hidden_size = 64
    num_attention_heads = 4
    num_key_value_heads = 2
    head_dim = 16
    rotary_embedding_base = 10000.0
    max_seq_len = 64
    rms_norm_eps = 1e-5


class ExLlamaV2RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return hidden_states * torch.rsqrt(variance + self.variance_epsilon) * self.weight


class ExLlamaV2Linear(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features, bias=False)

    def forward(self, hidden_states):
        return self.linear(hidden_states)


class ExLlamaV2DeviceContext:
    def __init__(self, config):
        inv_freq = 1.0 / (
            config.rotary_embedding_base
            ** (torch.arange(0, config.head_dim, 2, dtype=torch.float64) / config.head_dim)
        )
        t = torch.arange(config.max_seq_len, dtype=torch.float64)
        freqs = torch.einsum("i,j->ij", t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.sin = emb.sin()
        self.cos = emb.cos()


def rope_(x, sin, cos, past_len):
    """In-place-style neox rope on (batch, seq, heads, head_dim)."""
    seq = x.shape[1]
    half = x.shape[-1] // 2
    c = cos[past_len : past_len + seq][None, :, None, :].to(x.dtype)
    s = sin[past_len : past_len + seq][None, :, None, :].to(x.dtype)
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * c + rot * s


class Params:
    def __init__(self, batch_size, seq_len, past_len):
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.past_len = past_len

    def get_attn_mask(self, dtype):
        if self.seq_len == 1:
            return None
        attn_mask = torch.zeros((self.seq_len, self.past_len + self.seq_len), dtype=dtype)
        attn_mask_triu = torch.triu(torch.full((self.seq_len - 1, self.seq_len - 1), -65504.0, dtype=dtype))
        attn_mask[: self.seq_len - 1, self.past_len + 1 : self.past_len + self.seq_len] = attn_mask_triu
        return attn_mask


class ExLlamaV2Attention(nn.Module):
    def __init__(self, model, key, layer_idx, config):
        super().__init__()
        self.model = [model]  # not a submodule: the owner is reached through a list, as a back-reference
        self.key = key
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.num_kv_groups = self.num_heads // self.num_kv_heads
        self.head_dim = config.head_dim
        self.hidden_size = config.hidden_size
        self.input_layernorm = ExLlamaV2RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.q_proj = ExLlamaV2Linear(self.hidden_size, self.num_heads * self.head_dim)
        self.k_proj = ExLlamaV2Linear(self.hidden_size, self.num_kv_heads * self.head_dim)
        self.v_proj = ExLlamaV2Linear(self.hidden_size, self.num_kv_heads * self.head_dim)
        self.o_proj = ExLlamaV2Linear(self.num_heads * self.head_dim, self.hidden_size)
        self.npos_max = 64
        self.pos_emb = nn.Parameter(0.3 * torch.randn(self.head_dim, self.npos_max))

    def forward(self, hidden_states, cache=None, attn_params=None):
        return self.forward_torch(hidden_states, cache, attn_params)

    def forward_torch(self, hidden_states, cache=None, attn_params=None):
        residual = hidden_states
        batch_size, q_len, _ = hidden_states.shape
        past_len = 0 if cache is None else cache.current_seq_len
        constants = self.model[0].get_device_context()

        hidden_states = self.input_layernorm(hidden_states)
        query_states = self.q_proj.forward(hidden_states).view(batch_size, q_len, self.num_heads, self.head_dim)
        key_states = self.k_proj.forward(hidden_states).view(batch_size, q_len, self.num_kv_heads, self.head_dim)
        value_states = self.v_proj.forward(hidden_states).view(batch_size, q_len, self.num_kv_heads, self.head_dim)

        query_states = rope_(query_states, constants.sin, constants.cos, past_len)
        key_states = rope_(key_states, constants.sin, constants.cos, past_len)

        query_states = query_states.transpose(1, 2)
        key_states = key_states.transpose(1, 2)
        value_states = value_states.transpose(1, 2)
        key_states = key_states.repeat_interleave(self.num_kv_groups, dim=1)
        value_states = value_states.repeat_interleave(self.num_kv_groups, dim=1)

        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3))
        attn_weights *= 1 / math.sqrt(self.head_dim)
        attn_mask = attn_params.get_attn_mask(attn_weights.dtype)
        if attn_mask is not None:
            attn_weights = attn_weights + attn_mask
        # CoPE: contextual positions are counted by sigmoid gates from each key up to the query
        gates = torch.sigmoid(attn_weights)  # masked logits give gate 0
        pos = gates.flip(-1).cumsum(dim=-1).flip(-1).clamp(max=self.npos_max - 1)
        pos_ceil = pos.ceil().long()
        pos_floor = pos.floor().long()
        logits_int = torch.matmul(query_states, self.pos_emb)
        logits_ceil = logits_int.gather(-1, pos_ceil)
        logits_floor = logits_int.gather(-1, pos_floor)
        w = pos - pos_floor
        attn_weights = attn_weights + logits_ceil * w + logits_floor * (1 - w)
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).reshape((batch_size, q_len, self.num_heads * self.head_dim))
        hidden_states = self.o_proj.forward(attn_output)
        return hidden_states + residual


class ExLlamaV2(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self._device_context = ExLlamaV2DeviceContext(config)
        self.layers = nn.ModuleList([ExLlamaV2Attention(self, "model.layers.0.self_attn", 0, config)])

    def get_device_context(self):
        return self._device_context

    def forward(self, hidden_states):
        batch_size, seq_len, _ = hidden_states.shape
        attn_params = Params(batch_size, seq_len, 0)
        for module in self.layers:
            hidden_states = module.forward(hidden_states, cache=None, attn_params=attn_params)
        return hidden_states


def make_exllamav2_cope():
    torch.manual_seed(1776)
    model = ExLlamaV2(ExLlamaV2Config())
    with torch.no_grad():
        model.layers[0].input_layernorm.weight.uniform_(0.5, 1.5)

    return model.eval()


EXPECT = {'target': 'make_exllamav2_cope',
 'kind': 'causal-multihead',
 'ok': True,
 'layer': 'layers.0',
 'unsupported': 'contextual_positions',
 'style': 'exllamav2 forward_torch: refused (CoPE contextual position encoding: positions counted '
          'by sigmoid gates, interpolated learned position logits added to the scores)'}

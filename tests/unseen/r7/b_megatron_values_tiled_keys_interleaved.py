"""Megatron-core-style GPT stage ([s, b, h], linear_qkv per query group, 4 heads / 2 groups, rotary_percent 0.5,
query-key layer scaling); bug: the keys are expanded with repeat_interleave but the values with Tensor.repeat,
so query head h reads the values of group h % 2 while its scores use group h // 2."""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class TransformerConfig:
    num_layers: int = 1
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: int = 2
    ffn_hidden_size: int = 128
    kv_channels: int = 16
    add_bias_linear: bool = False
    add_qkv_bias: bool = True
    apply_query_key_layer_scaling: bool = True
    attention_softmax_in_fp32: bool = True
    layernorm_epsilon: float = 1e-5
    rotary_percent: float = 0.5
    rotary_base: int = 10000
    rotary_interleaved: bool = False
    pipeline_layer_offset: int = 2  # this stage holds layer 3 of the full model


class LinearWithBias(nn.Module):
    """Stands in for Column/RowParallelLinear on one rank: returns (output, output_bias)."""

    def __init__(self, input_size, output_size, bias=True, skip_bias_add=False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        self.bias = nn.Parameter(torch.zeros(output_size)) if bias else None
        self.skip_bias_add = skip_bias_add
        nn.init.normal_(self.weight, std=0.1)
        if self.bias is not None:
            nn.init.normal_(self.bias, std=0.02)

    def forward(self, x):
        bias = self.bias if not self.skip_bias_add else None
        output = F.linear(x, self.weight, bias)
        return output, (self.bias if self.skip_bias_add else None)


class RotaryEmbedding(nn.Module):
    def __init__(self, kv_channels, rotary_percent, rotary_interleaved=False, rotary_base=10000):
        super().__init__()
        dim = int(kv_channels * rotary_percent)
        self.rotary_interleaved = rotary_interleaved
        self.register_buffer(
            "inv_freq",
            1.0 / (rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)),
            persistent=False,
        )

    def forward(self, max_seq_len, offset=0):
        seq = (
            torch.arange(max_seq_len, device=self.inv_freq.device, dtype=self.inv_freq.dtype)
            + offset
        )
        freqs = torch.outer(seq, self.inv_freq)
        if not self.rotary_interleaved:
            emb = torch.cat((freqs, freqs), dim=-1)
        else:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(
                freqs.shape[0], -1
            )
        return emb[:, None, None, :]  # [s, 1, 1, dim]


def _rotate_half(x, rotary_interleaved):
    if not rotary_interleaved:
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1 = x[:, :, :, ::2]
    x2 = x[:, :, :, 1::2]
    x_new = torch.stack((-x2, x1), dim=-1)
    return x_new.view(x_new.shape[0], x_new.shape[1], x_new.shape[2], -1)


def apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=False):
    rot_dim = freqs.shape[-1]
    t, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    cos_ = torch.cos(freqs).to(t.dtype)
    sin_ = torch.sin(freqs).to(t.dtype)
    t = (t * cos_) + (_rotate_half(t, rotary_interleaved) * sin_)
    return torch.cat((t, t_pass), dim=-1)


class FusedScaleMaskSoftmax(nn.Module):
    def __init__(self, scale=None):
        super().__init__()
        self.scale = scale

    def forward(self, input, mask):
        if self.scale is not None:
            input = input * self.scale
        if mask is not None:
            input = input.masked_fill(mask, -10000.0)
        return torch.nn.Softmax(dim=-1)(input)


class DotProductAttention(nn.Module):
    def __init__(self, config, layer_number):
        super().__init__()
        self.config = config
        self.layer_number = max(1, layer_number)
        self.hidden_size_per_attention_head = config.kv_channels
        self.num_attention_heads_per_partition = config.num_attention_heads
        self.num_query_groups_per_partition = config.num_query_groups
        coeff = None
        self.norm_factor = math.sqrt(self.hidden_size_per_attention_head)
        if config.apply_query_key_layer_scaling:
            coeff = self.layer_number
            self.norm_factor *= coeff
        self.scale_mask_softmax = FusedScaleMaskSoftmax(scale=coeff)

    def forward(self, query, key, value, attention_mask):
        # query: [sq, b, np, hn]; key/value: [sk, b, ng, hn]
        if self.num_attention_heads_per_partition // self.num_query_groups_per_partition > 1:
            rep = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
            key = key.repeat_interleave(rep, dim=2)
            value = value.repeat(1, 1, rep, 1)
        output_size = (query.size(1), query.size(2), query.size(0), key.size(0))
        query = query.reshape(output_size[2], output_size[0] * output_size[1], -1)
        key = key.reshape(output_size[3], output_size[0] * output_size[1], -1)
        matmul_input_buffer = torch.zeros(
            output_size[0] * output_size[1],
            output_size[2],
            output_size[3],
            dtype=query.dtype,
            device=query.device,
        )
        matmul_result = torch.baddbmm(
            matmul_input_buffer,
            query.transpose(0, 1),
            key.transpose(0, 1).transpose(1, 2),
            beta=0.0,
            alpha=(1.0 / self.norm_factor),
        )
        attention_scores = matmul_result.view(*output_size)
        attention_probs = self.scale_mask_softmax(attention_scores, attention_mask)

        output_size = (value.size(1), value.size(2), query.size(0), value.size(3))
        value = value.view(value.size(0), output_size[0] * output_size[1], -1)
        attention_probs = attention_probs.view(output_size[0] * output_size[1], output_size[2], -1)
        context = torch.bmm(attention_probs, value.transpose(0, 1))
        context = context.view(*output_size)
        context = context.permute(2, 0, 1, 3).contiguous()
        return context.view(
            *context.size()[:-2],
            self.num_attention_heads_per_partition * self.hidden_size_per_attention_head,
        )


class SelfAttention(nn.Module):
    def __init__(self, config, layer_number):
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        self.hidden_size_per_attention_head = config.kv_channels
        self.num_attention_heads_per_partition = config.num_attention_heads
        self.num_query_groups_per_partition = config.num_query_groups
        self.query_projection_size = config.kv_channels * config.num_attention_heads
        self.kv_projection_size = config.kv_channels * config.num_query_groups
        self.linear_qkv = LinearWithBias(
            config.hidden_size,
            self.query_projection_size + 2 * self.kv_projection_size,
            bias=config.add_bias_linear or config.add_qkv_bias,
        )
        self.core_attention = DotProductAttention(config, layer_number)
        self.linear_proj = LinearWithBias(
            self.query_projection_size,
            config.hidden_size,
            bias=config.add_bias_linear,
            skip_bias_add=True,
        )

    def get_query_key_value_tensors(self, hidden_states):
        mixed_qkv, _ = self.linear_qkv(hidden_states)
        per_group = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        hn = self.hidden_size_per_attention_head
        # [sq, b, hp] --> [sq, b, ng, (np/ng + 2) * hn]
        new_tensor_shape = mixed_qkv.size()[:-1] + (
            self.num_query_groups_per_partition,
            (per_group + 2) * hn,
        )
        mixed_qkv = mixed_qkv.view(*new_tensor_shape)
        query, key, value = torch.split(mixed_qkv, [per_group * hn, hn, hn], dim=3)
        query = query.reshape(query.size(0), query.size(1), -1, hn)
        return query, key, value

    def forward(self, hidden_states, attention_mask, rotary_pos_emb=None):
        query, key, value = self.get_query_key_value_tensors(hidden_states)
        if rotary_pos_emb is not None:
            q_pos_emb, k_pos_emb = rotary_pos_emb
            query = apply_rotary_pos_emb_bshd(query, q_pos_emb, self.config.rotary_interleaved)
            key = apply_rotary_pos_emb_bshd(key, k_pos_emb, self.config.rotary_interleaved)
        core_attn_out = self.core_attention(query, key, value, attention_mask)
        output, bias = self.linear_proj(core_attn_out)
        return output, bias


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.linear_fc1 = LinearWithBias(
            config.hidden_size, config.ffn_hidden_size, bias=config.add_bias_linear
        )
        self.linear_fc2 = LinearWithBias(
            config.ffn_hidden_size, config.hidden_size, bias=config.add_bias_linear
        )

    def forward(self, hidden_states):
        intermediate, _ = self.linear_fc1(hidden_states)
        output, _ = self.linear_fc2(F.gelu(intermediate))
        return output


class TransformerLayer(nn.Module):
    def __init__(self, config, layer_number=1):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.self_attention = SelfAttention(config, layer_number)
        self.pre_mlp_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.mlp = MLP(config)

    def forward(self, hidden_states, attention_mask, rotary_pos_emb=None):
        residual = hidden_states
        attention_output, attention_bias = self.self_attention(
            self.input_layernorm(hidden_states),
            attention_mask=attention_mask,
            rotary_pos_emb=rotary_pos_emb,
        )
        if attention_bias is not None:
            attention_output = attention_output + attention_bias
        hidden_states = residual + attention_output
        return hidden_states + self.mlp(self.pre_mlp_layernorm(hidden_states))


class TransformerBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        offset = config.pipeline_layer_offset
        self.layers = nn.ModuleList(
            [TransformerLayer(config, i + 1 + offset) for i in range(config.num_layers)]
        )
        self.final_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)

    def forward(self, hidden_states, attention_mask, rotary_pos_emb=None):
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask, rotary_pos_emb)
        return self.final_layernorm(hidden_states)


class GPTModel(nn.Module):
    """A middle pipeline stage (no embedding, no output layer); input is [b, s, h]."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.rotary_pos_emb = RotaryEmbedding(
            config.kv_channels, config.rotary_percent, config.rotary_interleaved, config.rotary_base
        )
        self.decoder = TransformerBlock(config)

    def forward(self, decoder_input):
        seq_len = decoder_input.shape[1]
        attention_mask = torch.triu(
            torch.ones((1, 1, seq_len, seq_len), device=decoder_input.device), diagonal=1
        ).bool()
        rotary_pos_emb = self.rotary_pos_emb(seq_len).to(decoder_input.dtype)
        hidden_states = decoder_input.transpose(0, 1).contiguous()  # [s, b, h]
        hidden_states = self.decoder(
            hidden_states, attention_mask, rotary_pos_emb=(rotary_pos_emb, rotary_pos_emb)
        )
        return hidden_states.transpose(0, 1)


def make_gpt():
    return GPTModel(TransformerConfig())


EXPECT = {
    "target": "make_gpt",
    "kind": "causal-multihead",
    "ok": False,
    "stage": "context",
    "mistake": "kv_group_mapping",
    "layer": "decoder.layers.0.self_attention",
    "style": "Megatron-core GPTModel/SelfAttention/DotProductAttention (grouped linear_qkv split, apply_rotary_pos_emb_bshd, baddbmm with layer-number coeff, FusedScaleMaskSoftmax); values tiled with .repeat on the group axis",
}

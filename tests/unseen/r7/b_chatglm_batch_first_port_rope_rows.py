"""ChatGLM2/3 model ported to batch-first tensors (multi_query_group_num=2, interleaved rotary on half of each head);
bug: apply_rotary_pos_emb still takes the sequence length from dim 0, which is now the batch, so the rope cache
rows picked are 0..b-1 and every token of sequence i is rotated for position i."""

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, rope_ratio=1):
        super().__init__()
        self.dim = dim
        self.rope_ratio = rope_ratio

    def forward_impl(self, seq_len, n_elem, dtype, device, base=10000):
        base = base * self.rope_ratio
        theta = 1.0 / (
            base ** (torch.arange(0, n_elem, 2, dtype=torch.float64, device=device) / n_elem)
        )
        seq_idx = torch.arange(seq_len, dtype=torch.float64, device=device)
        idx_theta = torch.outer(seq_idx, theta)
        cache = torch.stack(
            [torch.cos(idx_theta), torch.sin(idx_theta)], dim=-1
        )  # [s, n_elem/2, 2]
        return cache.to(dtype)

    def forward(self, max_seq_len, dtype, device):
        return self.forward_impl(max_seq_len, self.dim, dtype=dtype, device=device)


def apply_rotary_pos_emb(x, rope_cache):
    # x: [b, sq, np, hn] after the port (was [sq, b, np, hn]); rope_cache: [sq, 1, rot_dim/2, 2]
    sq, b, np = x.size(0), x.size(1), x.size(2)
    rot_dim = rope_cache.shape[-2] * 2
    x, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    rope_cache = rope_cache[:sq]
    xshaped = x.reshape(sq, -1, np, rot_dim // 2, 2)
    rope_cache = rope_cache.view(sq, -1, 1, xshaped.size(3), 2)
    x_out2 = torch.stack(
        [
            xshaped[..., 0] * rope_cache[..., 0] - xshaped[..., 1] * rope_cache[..., 1],
            xshaped[..., 1] * rope_cache[..., 0] + xshaped[..., 0] * rope_cache[..., 1],
        ],
        -1,
    )
    x_out2 = x_out2.flatten(3)
    return torch.cat((x_out2, x_pass), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, normalized_shape, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(normalized_shape))
        self.eps = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.eps))


class CoreAttention(nn.Module):
    def __init__(self, config, layer_number):
        super().__init__()
        self.layer_number = max(1, layer_number)

    def forward(self, query_layer, key_layer, value_layer, attention_mask=None):
        # [b, sq, np, hn] -> [b, np, sq, hn]
        query_layer, key_layer, value_layer = [
            k.transpose(1, 2) for k in (query_layer, key_layer, value_layer)
        ]
        if attention_mask is None and query_layer.shape[2] == key_layer.shape[2]:
            context_layer = F.scaled_dot_product_attention(
                query_layer, key_layer, value_layer, is_causal=True
            )
        else:
            context_layer = F.scaled_dot_product_attention(
                query_layer, key_layer, value_layer, ~attention_mask
            )
        context_layer = context_layer.transpose(1, 2)
        return context_layer.reshape(*context_layer.size()[:-2], -1)


class SelfAttention(nn.Module):
    def __init__(self, config, layer_number):
        super().__init__()
        self.layer_number = max(1, layer_number)
        self.projection_size = config.kv_channels * config.num_attention_heads
        self.hidden_size_per_attention_head = self.projection_size // config.num_attention_heads
        self.num_attention_heads_per_partition = config.num_attention_heads
        self.multi_query_attention = config.multi_query_attention
        self.qkv_hidden_size = 3 * self.projection_size
        if self.multi_query_attention:
            self.num_multi_query_groups_per_partition = config.multi_query_group_num
            self.qkv_hidden_size = (
                self.projection_size
                + 2 * self.hidden_size_per_attention_head * config.multi_query_group_num
            )
        self.query_key_value = nn.Linear(
            config.hidden_size,
            self.qkv_hidden_size,
            bias=config.add_bias_linear or config.add_qkv_bias,
        )
        self.core_attention = CoreAttention(config, self.layer_number)
        self.dense = nn.Linear(
            self.projection_size, config.hidden_size, bias=config.add_bias_linear
        )

    def forward(self, hidden_states, attention_mask=None, rotary_pos_emb=None):
        # hidden_states: [b, sq, h]
        mixed_x_layer = self.query_key_value(hidden_states)
        hn = self.hidden_size_per_attention_head
        groups = self.num_multi_query_groups_per_partition
        (query_layer, key_layer, value_layer) = mixed_x_layer.split(
            [self.num_attention_heads_per_partition * hn, groups * hn, groups * hn], dim=-1
        )
        query_layer = query_layer.view(
            query_layer.size()[:-1] + (self.num_attention_heads_per_partition, hn)
        )
        key_layer = key_layer.view(key_layer.size()[:-1] + (groups, hn))
        value_layer = value_layer.view(value_layer.size()[:-1] + (groups, hn))

        if rotary_pos_emb is not None:
            query_layer = apply_rotary_pos_emb(query_layer, rotary_pos_emb)
            key_layer = apply_rotary_pos_emb(key_layer, rotary_pos_emb)

        per_group = self.num_attention_heads_per_partition // groups
        key_layer = key_layer.unsqueeze(-2).expand(-1, -1, -1, per_group, -1)
        key_layer = key_layer.contiguous().view(
            key_layer.size()[:2] + (self.num_attention_heads_per_partition, hn)
        )
        value_layer = value_layer.unsqueeze(-2).expand(-1, -1, -1, per_group, -1)
        value_layer = value_layer.contiguous().view(
            value_layer.size()[:2] + (self.num_attention_heads_per_partition, hn)
        )

        context_layer = self.core_attention(query_layer, key_layer, value_layer, attention_mask)
        return self.dense(context_layer)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(
            config.hidden_size, config.ffn_hidden_size * 2, bias=config.add_bias_linear
        )
        self.dense_4h_to_h = nn.Linear(
            config.ffn_hidden_size, config.hidden_size, bias=config.add_bias_linear
        )

    def forward(self, hidden_states):
        a, b = self.dense_h_to_4h(hidden_states).chunk(2, dim=-1)
        return self.dense_4h_to_h(F.silu(a) * b)


class GLMBlock(nn.Module):
    def __init__(self, config, layer_number):
        super().__init__()
        self.apply_residual_connection_post_layernorm = (
            config.apply_residual_connection_post_layernorm
        )
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.self_attention = SelfAttention(config, layer_number)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.mlp = MLP(config)

    def forward(self, hidden_states, attention_mask, rotary_pos_emb):
        layernorm_output = self.input_layernorm(hidden_states)
        attention_output = self.self_attention(
            layernorm_output, attention_mask, rotary_pos_emb=rotary_pos_emb
        )
        residual = (
            layernorm_output if self.apply_residual_connection_post_layernorm else hidden_states
        )
        layernorm_input = residual + attention_output
        layernorm_output = self.post_attention_layernorm(layernorm_input)
        residual = (
            layernorm_output if self.apply_residual_connection_post_layernorm else layernorm_input
        )
        return residual + self.mlp(layernorm_output)


class GLMTransformer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList([GLMBlock(config, i + 1) for i in range(config.num_layers)])
        self.final_layernorm = RMSNorm(config.hidden_size, eps=config.layernorm_epsilon)

    def forward(self, hidden_states, attention_mask, rotary_pos_emb):
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask, rotary_pos_emb)
        return self.final_layernorm(hidden_states)


class ChatGLMModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.seq_length = config.seq_length
        rotary_dim = config.kv_channels
        self.rotary_pos_emb = RotaryEmbedding(rotary_dim // 2, rope_ratio=config.rope_ratio)
        self.encoder = GLMTransformer(config)

    def forward(self, inputs_embeds, position_ids=None):
        batch_size, seq_length = inputs_embeds.shape[:2]
        rotary_pos_emb = self.rotary_pos_emb(
            self.seq_length, inputs_embeds.dtype, inputs_embeds.device
        )
        if position_ids is not None:
            rotary_pos_emb = rotary_pos_emb[position_ids]
        else:
            rotary_pos_emb = rotary_pos_emb[None, :seq_length]
        rotary_pos_emb = rotary_pos_emb.transpose(0, 1).contiguous()  # [s, 1, rot/2, 2]
        # batch-first port: no more transposes of the hidden states
        return self.encoder(inputs_embeds, None, rotary_pos_emb)


def make_chatglm():
    config = SimpleNamespace(
        hidden_size=128,
        num_attention_heads=8,
        kv_channels=16,
        multi_query_attention=True,
        multi_query_group_num=2,
        rope_ratio=50,
        seq_length=256,
        ffn_hidden_size=160,
        num_layers=1,
        layernorm_epsilon=1e-5,
        add_bias_linear=False,
        add_qkv_bias=True,
        apply_residual_connection_post_layernorm=False,
    )
    return ChatGLMModel(config)


EXPECT = {
    "target": "make_chatglm",
    "kind": "causal-multihead",
    "ok": False,
    "stage": "rotated_queries",
    "mistake": "rope_positions",
    "layer": "encoder.layers.0.self_attention",
    "style": "ChatGLM2/3 remote code ported to [b, s, h] (query_key_value split with multi_query_group_num, stack([cos, sin]) rope_cache, expand kv groups, SDPA is_causal); apply_rotary_pos_emb's sq = x.size(0) is now the batch size",
}

"""Megatron-core GPTModel (megatron/core/models/gpt) at toy size, sequence-first.

embedding (word_embeddings + learned_absolute position_embeddings), decoder = TransformerBlock with
layers.N = TransformerLayer(input_layernorm, self_attention, pre_mlp_layernorm, mlp), final_layernorm,
output_layer.  SelfAttention: linear_qkv laid out per query group [q | k | v] (here one query head
per group: MHA), hidden states [s, b, h], core_attention = DotProductAttention (baddbmm into
[b*np, sq, sk] with alpha 1/norm_factor, bool mask filled with -10000.0, softmax), linear_proj.
Slip: get_query_key_value_tensors of layer 1 uses the index-slicing variant
(config.qkv_split = ["split", "slice", "split"]) and its key slice repeats the query slice.
No cache.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": [
        "decoder.layers.0.self_attention",
        "decoder.layers.1.self_attention",
        "decoder.layers.2.self_attention",
    ],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "decoder.layers.1.self_attention",
    "stage": "keys",
    "mistake": "wrong_projection",
    "style": "megatron-core GPTModel: sequence-first [s, b, h] hidden states into the attention, linear_qkv per group "
    "[q|k|v], DotProductAttention baddbmm alpha=1/norm_factor, -10000.0 mask fill, linear_proj; slip: layer 1's "
    "sliced split takes the key from the query slice",
}


class TransformerConfig:
    num_layers = 3
    hidden_size = 64
    num_attention_heads = 4
    num_query_groups = 4
    ffn_hidden_size = 192
    kv_channels = 16
    layernorm_epsilon = 1e-5
    qkv_split = ["split", "slice", "split"]
    vocab_size = 125
    max_sequence_length = 64


class LanguageModelEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_sequence_length, config.hidden_size)

    def forward(self, input_ids, position_ids):
        embeddings = self.word_embeddings(input_ids) + self.position_embeddings(position_ids)
        return embeddings.transpose(0, 1).contiguous()  # [s, b, h]


class DotProductAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.hidden_size_per_attention_head = config.kv_channels
        self.num_attention_heads_per_partition = config.num_attention_heads
        self.norm_factor = math.sqrt(self.hidden_size_per_attention_head)

    def forward(self, query, key, value, attention_mask):
        # query/key/value: [sq, b, np, hn]
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
        attention_scores = attention_scores.masked_fill(attention_mask, -10000.0)
        attention_probs = torch.softmax(attention_scores, dim=-1)
        output_size = (value.size(1), value.size(2), query.size(0), value.size(3))
        value = value.reshape(value.size(0), output_size[0] * output_size[1], -1)
        attention_probs = attention_probs.view(output_size[0] * output_size[1], output_size[2], -1)
        context = torch.bmm(attention_probs, value.transpose(0, 1))
        context = context.view(*output_size).permute(2, 0, 1, 3).contiguous()
        return context.view(context.size(0), context.size(1), -1)  # [sq, b, hp]


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
        self.linear_qkv = nn.Linear(
            config.hidden_size, self.query_projection_size + 2 * self.kv_projection_size, bias=True
        )
        self.core_attention = DotProductAttention(config)
        self.linear_proj = nn.Linear(self.query_projection_size, config.hidden_size, bias=True)
        self.split_kind = config.qkv_split[layer_number - 1]

    def get_query_key_value_tensors(self, hidden_states):
        mixed_qkv = self.linear_qkv(hidden_states)
        np_per_group = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        hn = self.hidden_size_per_attention_head
        new_tensor_shape = mixed_qkv.size()[:-1] + (
            self.num_query_groups_per_partition,
            (np_per_group + 2) * hn,
        )
        mixed_qkv = mixed_qkv.view(*new_tensor_shape)
        if self.split_kind == "split":
            query, key, value = torch.split(mixed_qkv, [np_per_group * hn, hn, hn], dim=3)
        else:
            q_end = np_per_group * hn
            query = mixed_qkv[..., 0:q_end]
            key = mixed_qkv[..., 0:hn]
            value = mixed_qkv[..., q_end + hn : q_end + 2 * hn]
        query = query.reshape(query.size(0), query.size(1), -1, hn)
        return query, key, value

    def forward(self, hidden_states, attention_mask):
        query, key, value = self.get_query_key_value_tensors(hidden_states)
        core_attn_out = self.core_attention(query, key, value, attention_mask)
        return self.linear_proj(core_attn_out)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.linear_fc1 = nn.Linear(config.hidden_size, config.ffn_hidden_size)
        self.linear_fc2 = nn.Linear(config.ffn_hidden_size, config.hidden_size)

    def forward(self, x):
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class TransformerLayer(nn.Module):
    def __init__(self, config, layer_number):
        super().__init__()
        self.layer_number = layer_number
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.self_attention = SelfAttention(config, layer_number)
        self.pre_mlp_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.mlp = MLP(config)

    def forward(self, hidden_states, attention_mask):
        residual = hidden_states
        hidden_states = residual + self.self_attention(
            self.input_layernorm(hidden_states), attention_mask
        )
        residual = hidden_states
        return residual + self.mlp(self.pre_mlp_layernorm(hidden_states))


class TransformerBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList(
            [TransformerLayer(config, i + 1) for i in range(config.num_layers)]
        )
        self.final_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)

    def forward(self, hidden_states, attention_mask):
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask)
        return self.final_layernorm(hidden_states)


class GPTModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embedding = LanguageModelEmbedding(config)
        self.decoder = TransformerBlock(config)
        self.output_layer = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, position_ids=None, attention_mask=None):
        b, s = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(s, device=input_ids.device).unsqueeze(0).expand(b, -1)
        if attention_mask is None:
            attention_mask = torch.triu(
                torch.ones(s, s, device=input_ids.device, dtype=torch.bool), diagonal=1
            )[None, None]
        hidden = self.decoder(self.embedding(input_ids, position_ids), attention_mask)
        return self.output_layer(hidden).transpose(0, 1).contiguous()  # [b, s, v]


def make_model():
    torch.manual_seed(708)
    model = GPTModel(TransformerConfig())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Linear):
                m.weight.normal_(0.0, 0.1)
                if m.bias is not None:
                    m.bias.normal_(0.0, 0.05)
            elif isinstance(m, nn.Embedding):
                m.weight.normal_(0.0, 0.5)
            elif isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn_like(m.weight))
                m.bias.copy_(0.1 * torch.randn_like(m.bias))
    return model.eval()

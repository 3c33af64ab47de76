"""bigscience Megatron-DeepSpeed (BLOOM training code) style ParallelAttention with ALiBi, in a small
GPT model body that works sequence-first [s, b, h]: query_key_value packed per head as
[np, 3 * hn] and split along the last dim, the ALiBi tensor built by the model as slopes * arange(key)
(the key-position-only form, repeated over the batch to [b * np, 1, s]) and used as the baddbmm input
with beta=1.0 and alpha=1/norm_factor, a boolean causal mask (triu > 0.5) applied by
attention_mask_func with -10000.0 inside a torch fallback of FusedScaleMaskSoftmax, bmm with values,
permute(2, 0, 1, 3) back to [s, b, h] and the dense output projection. 6 heads (not a power of two).

This file's one bug: Megatron-DeepSpeed ParallelAttention: baddbmm called with beta=0.0 in the alibi
branch too (copied from the empty-buffer branch), so the ALiBi input is ignored."""

import math

import torch
from torch import nn


def get_slopes(n):
    def get_slopes_power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        ratio = start
        return [start * ratio**i for i in range(n)]

    if math.log2(n).is_integer():
        return get_slopes_power_of_2(n)
    closest_power_of_2 = 2 ** math.floor(math.log2(n))
    return (
        get_slopes_power_of_2(closest_power_of_2)
        + get_slopes(2 * closest_power_of_2)[0::2][: n - closest_power_of_2]
    )


def build_alibi_tensor(max_seq_len, num_attention_heads, batch_size):
    slopes = torch.tensor(get_slopes(num_attention_heads), dtype=torch.float64)
    alibi = slopes.unsqueeze(1).unsqueeze(1) * torch.arange(
        max_seq_len, dtype=torch.float64
    ).unsqueeze(0).unsqueeze(0).expand(num_attention_heads, -1, -1)
    alibi = alibi.repeat(batch_size, 1, 1)
    return alibi


def attention_mask_func(attention_scores, attention_mask):
    attention_scores.masked_fill_(attention_mask, -10000.0)
    return attention_scores


class FusedScaleMaskSoftmax(nn.Module):
    def __init__(self, mask_func, softmax_in_fp32, scale):
        super().__init__()
        self.mask_func = mask_func
        self.softmax_in_fp32 = softmax_in_fp32
        self.scale = scale

    def forward(self, input, mask):
        if self.scale is not None:
            input = input * self.scale
        mask_output = self.mask_func(input, mask) if mask is not None else input
        return torch.nn.Softmax(dim=-1)(mask_output)


class ParallelAttention(nn.Module):
    def __init__(
        self, hidden_size, num_attention_heads, layer_number, apply_query_key_layer_scaling=True
    ):
        super().__init__()
        self.layer_number = max(1, layer_number)
        self.hidden_size_per_partition = hidden_size
        self.hidden_size_per_attention_head = hidden_size // num_attention_heads
        self.num_attention_heads_per_partition = num_attention_heads
        self.query_key_value = nn.Linear(hidden_size, 3 * hidden_size)
        coeff = None
        self.norm_factor = math.sqrt(self.hidden_size_per_attention_head)
        if apply_query_key_layer_scaling:
            coeff = self.layer_number
            self.norm_factor *= coeff
        self.scale_mask_softmax = FusedScaleMaskSoftmax(attention_mask_func, True, coeff)
        self.dense = nn.Linear(hidden_size, hidden_size)

    def forward(self, hidden_states, attention_mask, alibi=None):
        mixed_x_layer = self.query_key_value(hidden_states)
        new_tensor_shape = mixed_x_layer.size()[:-1] + (
            self.num_attention_heads_per_partition,
            3 * self.hidden_size_per_attention_head,
        )
        mixed_x_layer = mixed_x_layer.view(*new_tensor_shape)
        query_layer, key_layer, value_layer = torch.split(
            mixed_x_layer, self.hidden_size_per_attention_head, dim=-1
        )

        output_size = (
            query_layer.size(1),
            query_layer.size(2),
            query_layer.size(0),
            key_layer.size(0),
        )
        query_layer = query_layer.reshape(output_size[2], output_size[0] * output_size[1], -1)
        key_layer = key_layer.reshape(output_size[3], output_size[0] * output_size[1], -1)

        if alibi is None:
            matmul_result = torch.empty(
                output_size[0] * output_size[1],
                output_size[2],
                output_size[3],
                dtype=query_layer.dtype,
                device=query_layer.device,
            )
            beta = 0.0
        else:
            matmul_result = alibi[: output_size[0] * output_size[1], :, : output_size[3]].to(
                query_layer.dtype
            )
            beta = 0.0
        matmul_result = torch.baddbmm(
            matmul_result,
            query_layer.transpose(0, 1),
            key_layer.transpose(0, 1).transpose(1, 2),
            beta=beta,
            alpha=(1.0 / self.norm_factor),
        )
        attention_scores = matmul_result.view(*output_size)
        attention_probs = self.scale_mask_softmax(attention_scores, attention_mask)

        output_size = (
            value_layer.size(1),
            value_layer.size(2),
            query_layer.size(0),
            value_layer.size(3),
        )
        value_layer = value_layer.reshape(value_layer.size(0), output_size[0] * output_size[1], -1)
        attention_probs = attention_probs.view(output_size[0] * output_size[1], output_size[2], -1)
        context_layer = torch.bmm(attention_probs, value_layer.transpose(0, 1))
        context_layer = context_layer.view(*output_size)
        context_layer = context_layer.permute(2, 0, 1, 3).contiguous()
        new_context_layer_shape = context_layer.size()[:-2] + (self.hidden_size_per_partition,)
        context_layer = context_layer.view(*new_context_layer_shape)
        return self.dense(context_layer)


class ParallelTransformerLayer(nn.Module):
    def __init__(self, hidden_size, num_attention_heads, layer_number):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(hidden_size)
        self.self_attention = ParallelAttention(hidden_size, num_attention_heads, layer_number)
        self.post_attention_layernorm = nn.LayerNorm(hidden_size)
        self.mlp = nn.Sequential(
            nn.Linear(hidden_size, 4 * hidden_size),
            nn.GELU(),
            nn.Linear(4 * hidden_size, hidden_size),
        )

    def forward(self, hidden_states, attention_mask, alibi):
        layernorm_output = self.input_layernorm(hidden_states)
        attention_output = self.self_attention(layernorm_output, attention_mask, alibi=alibi)
        layernorm_input = hidden_states + attention_output
        layernorm_output = self.post_attention_layernorm(layernorm_input)
        return layernorm_input + self.mlp(layernorm_output)


class ParallelTransformer(nn.Module):
    def __init__(self, hidden_size, num_attention_heads, num_layers):
        super().__init__()
        self.layers = nn.ModuleList(
            [
                ParallelTransformerLayer(hidden_size, num_attention_heads, i + 1)
                for i in range(num_layers)
            ]
        )
        self.final_layernorm = nn.LayerNorm(hidden_size)

    def forward(self, hidden_states, attention_mask, alibi):
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask, alibi)
        return self.final_layernorm(hidden_states)


class TransformerLanguageModel(nn.Module):
    def __init__(self, hidden_size, num_attention_heads, num_layers):
        super().__init__()
        self.encoder = ParallelTransformer(hidden_size, num_attention_heads, num_layers)


class GPTModel(nn.Module):
    def __init__(self, hidden_size=96, num_attention_heads=6, num_layers=1, seq_length=64):
        super().__init__()
        self.num_attention_heads = num_attention_heads
        self.seq_length = seq_length
        self.language_model = TransformerLanguageModel(hidden_size, num_attention_heads, num_layers)

    def forward(self, embeddings):
        b, s, _ = embeddings.shape
        hidden_states = embeddings.transpose(0, 1).contiguous()
        attention_mask = (
            torch.triu(torch.ones((1, 1, s, s), device=embeddings.device), diagonal=1) > 0.5
        )
        alibi = build_alibi_tensor(self.seq_length, self.num_attention_heads, b).to(
            embeddings.device
        )
        hidden_states = self.language_model.encoder(hidden_states, attention_mask, alibi)
        return hidden_states.transpose(0, 1).contiguous()


def make_megatron_gpt():
    torch.manual_seed(1207)
    model = GPTModel()
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {
    "target": "make_megatron_gpt",
    "kind": "causal-multihead",
    "ok": False,
    "layer": "language_model.encoder.layers.0.self_attention",
    "stage": "biased_scores",
    "mistake": "bias_missing",
    "style": "Megatron-DeepSpeed ParallelAttention: baddbmm called with beta=0.0 in the alibi branch "
    "too (copied from the empty-buffer branch), so the ALiBi input is ignored",
}

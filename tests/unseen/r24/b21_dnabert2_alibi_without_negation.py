"""zhihan1996 DNABERT-2 remote code (bert_layers.py, BertUnpadSelfAttention, padded torch path): a fused
`Wqkv` Linear (bias) viewed (b, s, 3, heads, head_dim), q permuted (0, 2, 1, 3) and k permuted
(0, 2, 3, 1), matmul / sqrt(head_size), plus `bias` = the extended padding mask (all zero here) + the
ALiBi tensor that `BertEncoder.rebuild_alibi_tensor` builds once for the model: `_get_alibi_head_slopes`
(geometric, with the interleave rule for a head count that is not a power of two) times
-|i - j| (symmetric, encoder). Softmax, matmul with the values, heads merged with
`rearrange('... h d -> ... (h d)')` written as a reshape; BertSelfOutput (dense, LayerNorm with the
residual). Not causal. 6 heads of 16 (d_model 96).

This file: one bug: alibi = slopes * relative_position without the minus, so distant tokens are favoured."""

import math

import torch
from torch import nn


class BertConfig:
    hidden_size = 96
    num_attention_heads = 6
    alibi_starting_size = 512
    layer_norm_eps = 1e-12
    intermediate_size = 192


def _get_alibi_head_slopes(n_heads):
    def get_slopes_power_of_2(n_heads):
        start = 2 ** (-(2 ** -(math.log2(n_heads) - 3)))
        ratio = start
        return [start * ratio**i for i in range(n_heads)]

    if math.log2(n_heads).is_integer():
        return get_slopes_power_of_2(n_heads)
    closest_power_of_2 = 2 ** math.floor(math.log2(n_heads))
    slopes_a = get_slopes_power_of_2(closest_power_of_2)
    slopes_b = _get_alibi_head_slopes(2 * closest_power_of_2)
    slopes_b = slopes_b[0::2][: n_heads - closest_power_of_2]
    return slopes_a + slopes_b


class BertUnpadSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.Wqkv = nn.Linear(config.hidden_size, 3 * self.all_head_size)

    def forward(self, hidden_states, bias):
        b, s, _ = hidden_states.shape
        qkv = self.Wqkv(hidden_states)
        qkv = qkv.view(b, s, 3, self.num_attention_heads, self.attention_head_size)
        q = qkv[:, :, 0, :, :].permute(0, 2, 1, 3)  # b h s d
        k = qkv[:, :, 1, :, :].permute(0, 2, 3, 1)  # b h d s
        v = qkv[:, :, 2, :, :].permute(0, 2, 1, 3)  # b h s d
        attention_scores = torch.matmul(q, k) / math.sqrt(self.attention_head_size)
        attention_scores = attention_scores + bias
        attention_probs = nn.functional.softmax(attention_scores, dim=-1)
        attention = torch.matmul(attention_probs, v).permute(0, 2, 1, 3)  # b s h d
        return attention.reshape(b, s, self.all_head_size)


class BertSelfOutput(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states, input_tensor):
        return self.LayerNorm(self.dense(hidden_states) + input_tensor)


class BertUnpadAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self = BertUnpadSelfAttention(config)
        self.output = BertSelfOutput(config)

    def forward(self, input_tensor, bias):
        return self.output(self.self(input_tensor, bias), input_tensor)


class BertLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention = BertUnpadAttention(config)
        self.gated_layers = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.wo = nn.Linear(config.intermediate_size, config.hidden_size)
        self.layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states, bias):
        attention_output = self.attention(hidden_states, bias)
        gated, non_gated = self.gated_layers(attention_output).chunk(2, dim=-1)
        return self.layernorm(self.wo(nn.functional.gelu(gated) * non_gated) + attention_output)


class BertEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layer = nn.ModuleList([BertLayer(config)])
        self.num_attention_heads = config.num_attention_heads
        self._current_alibi_size = int(config.alibi_starting_size)
        self.alibi = torch.zeros((1, self.num_attention_heads, self._current_alibi_size, self._current_alibi_size))
        self.rebuild_alibi_tensor(size=config.alibi_starting_size)

    def rebuild_alibi_tensor(self, size, device=None):
        n_heads = self.num_attention_heads
        context_position = torch.arange(size, device=device)[:, None]
        memory_position = torch.arange(size, device=device)[None, :]
        relative_position = torch.abs(memory_position - context_position)
        relative_position = relative_position.unsqueeze(0).expand(n_heads, -1, -1)
        slopes = torch.tensor(_get_alibi_head_slopes(n_heads), dtype=torch.float64, device=device)
        alibi = slopes.unsqueeze(1).unsqueeze(1) * relative_position
        alibi = alibi.unsqueeze(0)
        self._current_alibi_size = size
        self.alibi = alibi

    def forward(self, hidden_states, attention_mask):
        seqlen = hidden_states.shape[1]
        extended_attention_mask = attention_mask[:, None, None, :].to(hidden_states.dtype)
        extended_attention_mask = (1.0 - extended_attention_mask) * -10000.0
        alibi_bias = self.alibi[:, :, :seqlen, :seqlen].to(hidden_states.dtype)
        attn_bias = extended_attention_mask + alibi_bias
        for layer_module in self.layer:
            hidden_states = layer_module(hidden_states, attn_bias)
        return hidden_states


class DnaBertEncoderStack(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.encoder = BertEncoder(config)

    def forward(self, inputs_embeds):
        attention_mask = torch.ones(inputs_embeds.shape[:2], device=inputs_embeds.device)
        return self.encoder(inputs_embeds, attention_mask)


def make_dnabert2():
    torch.manual_seed(2452)
    model = DnaBertEncoderStack(BertConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {'target': 'make_dnabert2',
 'kind': 'multihead',
 'ok': False,
 'layer': 'encoder.layer.0.attention.self',
 'stage': 'biased_scores',
 'mistake': 'bias_sign',
 'style': 'DNABERT-2 rebuild_alibi_tensor: slopes * relative_position (sign lost)'}

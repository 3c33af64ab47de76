"""MosaicBERT (mosaicml examples bert_layers.py) padded torch path: BertEncoder builds the symmetric
ALiBi tensor (slopes * -|i - j|, _get_alibi_head_slopes with the interleaved non-power-of-two rule for
6 heads) once and adds the extended padding mask, then passes the bias down; BertSelfAttention:
fused Wqkv viewed (b, s, 3, h, d), k permuted to (b, h, d, s), matmul / sqrt(d) + bias, softmax; no
output projection in this module (BertSelfOutput's dense + post-LN). GLU MLP. d_model 96.

This file: bug. The extra slopes for 6 heads are taken from the odd entries of the 8-head sequence
([1::2]: 1/4, 1/16) instead of the even ones (1/2, 1/8)."""

import math

import torch
import torch.nn as nn


class BertConfig:
    hidden_size = 96
    num_attention_heads = 6
    intermediate_size = 192
    attention_probs_dropout_prob = 0.0
    hidden_dropout_prob = 0.1
    layer_norm_eps = 1e-12
    num_hidden_layers = 1
    alibi_starting_size = 128


class BertSelfAttention(nn.Module):
    """MosaicBERT self-attention, padded (torch) path: fused Wqkv, no output projection here
    (BertSelfOutput applies it); the ALiBi + padding bias comes from the encoder."""

    def __init__(self, config):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = int(config.hidden_size / config.num_attention_heads)
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)
        self.Wqkv = nn.Linear(self.all_head_size, 3 * config.hidden_size)

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
        attention_probs = self.dropout(attention_probs)
        attention = torch.matmul(attention_probs, v).permute(0, 2, 1, 3)  # b s h d
        return attention.reshape(b, s, self.all_head_size)


class BertSelfOutput(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states, input_tensor):
        hidden_states = self.dropout(self.dense(hidden_states))
        return self.LayerNorm(hidden_states + input_tensor)


class BertUnpadAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertSelfOutput(config)

    def forward(self, input_tensor, bias):
        self_output = self.self(input_tensor, bias)
        return self.output(self_output, input_tensor)


class BertGatedLinearUnitMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gated_layers = nn.Linear(config.hidden_size, config.intermediate_size * 2, bias=False)
        self.act = nn.GELU(approximate="none")
        self.wo = nn.Linear(config.intermediate_size, config.hidden_size)
        self.layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states):
        residual_connection = hidden_states
        hidden_states = self.gated_layers(hidden_states)
        gated = hidden_states[..., : self.wo.in_features]
        non_gated = hidden_states[..., self.wo.in_features :]
        hidden_states = self.wo(self.act(gated) * non_gated)
        return self.layernorm(hidden_states + residual_connection)


class BertLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention = BertUnpadAttention(config)
        self.mlp = BertGatedLinearUnitMLP(config)

    def forward(self, hidden_states, bias):
        return self.mlp(self.attention(hidden_states, bias))


class BertEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layer = nn.ModuleList([BertLayer(config) for _ in range(config.num_hidden_layers)])
        self.num_attention_heads = config.num_attention_heads
        self._current_alibi_size = int(config.alibi_starting_size)
        self.alibi = torch.zeros(
            (1, self.num_attention_heads, self._current_alibi_size, self._current_alibi_size)
        )
        self.rebuild_alibi_tensor(size=config.alibi_starting_size)

    def rebuild_alibi_tensor(self, size, device=None):
        n_heads = self.num_attention_heads

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
            slopes_b = slopes_b[1::2][: n_heads - closest_power_of_2]
            return slopes_a + slopes_b

        context_position = torch.arange(size, device=device)[:, None]
        memory_position = torch.arange(size, device=device)[None, :]
        relative_position = torch.abs(memory_position - context_position)
        # [n_heads, max_token, max_token]
        relative_position = relative_position.unsqueeze(0).expand(n_heads, -1, -1)
        slopes = torch.tensor(_get_alibi_head_slopes(n_heads), dtype=torch.float64, device=device)
        alibi = slopes.unsqueeze(1).unsqueeze(1) * -relative_position
        # [1, n_heads, max_token, max_token]
        alibi = alibi.unsqueeze(0)
        self._current_alibi_size = size
        self.alibi = alibi

    def forward(self, hidden_states, attention_mask):
        extended_attention_mask = attention_mask.unsqueeze(1).unsqueeze(2)
        extended_attention_mask = extended_attention_mask.to(dtype=hidden_states.dtype)
        extended_attention_mask = (1.0 - extended_attention_mask) * -10000.0
        seqlen = hidden_states.shape[1]
        attn_bias = extended_attention_mask[:, :, :seqlen, :seqlen]
        alibi_bias = self.alibi[:, :, :seqlen, :seqlen].to(
            device=hidden_states.device, dtype=hidden_states.dtype
        )
        alibi_attn_mask = attn_bias + alibi_bias
        for layer_module in self.layer:
            hidden_states = layer_module(hidden_states, alibi_attn_mask)
        return hidden_states


class BertModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embeddings_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.encoder = BertEncoder(config)

    def forward(self, inputs_embeds):
        attention_mask = torch.ones(
            inputs_embeds.shape[:2], dtype=torch.long, device=inputs_embeds.device
        )
        hidden_states = self.embeddings_norm(inputs_embeds)
        return self.encoder(hidden_states, attention_mask)


def make_mosaic_bert():
    torch.manual_seed(1335)
    model = BertModel(BertConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {
    "target": "make_mosaic_bert",
    "kind": "multihead",
    "ok": False,
    "layer": "encoder.layer.0.attention.self",
    "stage": "biased_scores",
    "mistake": "bias_slopes",
    "style": "MosaicBERT _get_alibi_head_slopes: slopes_b[1::2] for the non-power-of-two heads (6 "
    "heads)",
}

"""LAION CLAP text tower (ClapTextModel, a RoBERTa encoder) self-attention, as in Hugging Face's
ClapTextSelfAttention: separate biased query/key/value projections, heads by view + permute,
1/sqrt(head_size) scale, additive extended padding mask built by the model, eager softmax.
Like BERT's self-attention it has no output projection of its own: the merged heads go to
ClapTextSelfOutput (dense + LayerNorm + residual) in the next module.

This file: one bug: log_softmax where softmax is meant: the weights are log-probabilities."""

import math

import torch
import torch.nn.functional as F
from torch import nn


class ClapTextConfig:
    hidden_size = 64
    num_attention_heads = 4
    intermediate_size = 128
    layer_norm_eps = 1e-12
    max_position_embeddings = 64


class ClapTextSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.query = nn.Linear(config.hidden_size, self.all_head_size)
        self.key = nn.Linear(config.hidden_size, self.all_head_size)
        self.value = nn.Linear(config.hidden_size, self.all_head_size)

    def transpose_for_scores(self, x):
        new_x_shape = x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)
        x = x.view(new_x_shape)
        return x.permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask=None):
        query_layer = self.transpose_for_scores(self.query(hidden_states))
        key_layer = self.transpose_for_scores(self.key(hidden_states))
        value_layer = self.transpose_for_scores(self.value(hidden_states))
        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        if attention_mask is not None:
            attention_scores = attention_scores + attention_mask
        attention_probs = nn.functional.log_softmax(attention_scores, dim=-1)
        context_layer = torch.matmul(attention_probs, value_layer)
        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        new_context_layer_shape = context_layer.size()[:-2] + (self.all_head_size,)
        return context_layer.view(new_context_layer_shape)


class ClapTextSelfOutput(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states, input_tensor):
        return self.LayerNorm(self.dense(hidden_states) + input_tensor)


class ClapTextAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self = ClapTextSelfAttention(config)
        self.output = ClapTextSelfOutput(config)

    def forward(self, hidden_states, attention_mask=None):
        return self.output(self.self(hidden_states, attention_mask), hidden_states)


class ClapTextLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention = ClapTextAttention(config)
        self.intermediate = nn.Linear(config.hidden_size, config.intermediate_size)
        self.output_dense = nn.Linear(config.intermediate_size, config.hidden_size)
        self.output_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states, attention_mask=None):
        attn = self.attention(hidden_states, attention_mask)
        ff = self.output_dense(F.gelu(self.intermediate(attn)))
        return self.output_norm(ff + attn)


class ClapTextEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList([ClapTextLayer(config)])

    def forward(self, inputs_embeds):
        bsz, seq_len, _ = inputs_embeds.shape
        # all tokens real: the 0/1 padding mask becomes an all-zero additive mask (b, 1, 1, n)
        padding = torch.ones(bsz, seq_len, dtype=inputs_embeds.dtype, device=inputs_embeds.device)
        extended = (1.0 - padding[:, None, None, :]) * torch.finfo(inputs_embeds.dtype).min
        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(hidden_states, extended)
        return hidden_states


def make_clap_text_encoder():
    torch.manual_seed(5206)
    model = ClapTextEncoder(ClapTextConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
            elif isinstance(mod, nn.Linear):
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {
    "target": "make_clap_text_encoder",
    "kind": "multihead",
    "ok": False,
    "layer": "layers.0.attention.self",
    "stage": "weights",
    "mistake": "not_softmax",
    "style": "LAION CLAP text self-attention: one bug: log_softmax where softmax is meant: the weights are log-probabilities (twin: c06)",
}

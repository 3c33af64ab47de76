"""THUDM/CodeGeeX (codegeex/torch/codegeex_model.py, the PanGu-alpha derived GPT) in plain torch.

Kept: `language_model.embedding` (`word_embeddings`, learned `position_embeddings`),
`language_model.transformer.layers.N` (TransformerLayer: `input_layernorm`, `attention` =
SelfAttention with separate `query`/`key`/`value` Linears and `dense`, `post_attention_layernorm`,
`mlp` with `dense_h_to_4h`/`dense_4h_to_h` and Mindspore's fast_gelu), `final_layernorm`, logits
against the word embeddings.  Hidden states are sequence-first [s, b, h]; the attention views each
projection as [s, b, np, hn], folds it to [b*np, s, hn] and multiplies with `baddbmm`-style
bmm / norm_factor (sqrt(hn)), fills the boolean future mask with -10000.0, takes the softmax in float32
and multiplies with the values, then permutes back to [s, b, h] for `dense`.
(CodeGeeX's extra `topQueryLayer` at the end is not built: this is the plain-layer stack.)
Slip: layer 1's key path was rewritten for a head-minor fused-weight checkpoint and views the key
projection as [s, b, hn, np] before moving the last two axes, so each "head" of keys gathers one
feature from every head: heads cut from the wrong axis.  Queries and values are split as usual.
No cache.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": [
        "language_model.transformer.layers.0.attention",
        "language_model.transformer.layers.1.attention",
        "language_model.transformer.layers.2.attention",
    ],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "language_model.transformer.layers.1.attention",
    "stage": "keys",
    "mistake": "heads_split",
    "style": "CodeGeeX codegeex_model.py: sequence-first [s, b, h], separate query/key/value + dense, "
    "[b*np, s, hn] bmm / norm_factor, masked_fill -10000.0, fast_gelu MLP, tied output; layer 1 views keys "
    "as [s, b, hn, np] (head-minor) and transposes",
}


def fast_gelu(x):
    return x / (1 + torch.exp(-1.702 * torch.abs(x))) * torch.exp(0.851 * (x - torch.abs(x)))


class SelfAttention(nn.Module):
    def __init__(self, hidden_size, num_attention_heads, layer_number, head_minor_keys=False):
        super().__init__()
        self.hidden_size = hidden_size
        self.num_attention_heads = num_attention_heads
        self.hidden_size_per_attention_head = hidden_size // num_attention_heads
        self.layer_number = max(1, layer_number)
        self.head_minor_keys = head_minor_keys
        self.query = nn.Linear(hidden_size, hidden_size)
        self.key = nn.Linear(hidden_size, hidden_size)
        self.value = nn.Linear(hidden_size, hidden_size)
        self.norm_factor = math.sqrt(self.hidden_size_per_attention_head)
        self.dense = nn.Linear(hidden_size, hidden_size)

    def forward(self, hidden_states, attention_mask):
        # hidden_states: [sq, b, h]; attention_mask: bool [1, 1, sq, sk], True = masked
        query_layer = self.query(hidden_states)
        key_layer = self.key(hidden_states)
        value_layer = self.value(hidden_states)
        new_shape = query_layer.size()[:-1] + (self.num_attention_heads, self.hidden_size_per_attention_head)
        query_layer = query_layer.view(*new_shape)
        if self.head_minor_keys:
            key_shape = key_layer.size()[:-1] + (self.hidden_size_per_attention_head, self.num_attention_heads)
            key_layer = key_layer.view(*key_shape).transpose(-1, -2).contiguous()
        else:
            key_layer = key_layer.view(*new_shape)
        value_layer = value_layer.view(*new_shape)

        sq, b, np_, hn = query_layer.shape
        sk = key_layer.size(0)
        query_layer = query_layer.reshape(sq, b * np_, hn)
        key_layer = key_layer.reshape(sk, b * np_, hn)
        matmul_result = torch.bmm(query_layer.transpose(0, 1), key_layer.permute(1, 2, 0)) / self.norm_factor
        attention_scores = matmul_result.view(b, np_, sq, sk)
        attention_scores = attention_scores.masked_fill(attention_mask, -10000.0)
        if attention_scores.dtype == torch.float64:
            attention_probs = F.softmax(attention_scores, dim=-1)
        else:
            attention_probs = F.softmax(attention_scores.float(), dim=-1).type_as(value_layer)

        value_layer = value_layer.reshape(sk, b * np_, hn)
        attention_probs = attention_probs.view(b * np_, sq, sk)
        context_layer = torch.bmm(attention_probs, value_layer.transpose(0, 1))
        context_layer = context_layer.view(b, np_, sq, hn).permute(2, 0, 1, 3).contiguous()
        context_layer = context_layer.view(sq, b, self.hidden_size)
        return self.dense(context_layer)


class MLP(nn.Module):
    def __init__(self, hidden_size):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(hidden_size, 4 * hidden_size)
        self.dense_4h_to_h = nn.Linear(4 * hidden_size, hidden_size)

    def forward(self, hidden_states):
        return self.dense_4h_to_h(fast_gelu(self.dense_h_to_4h(hidden_states)))


class TransformerLayer(nn.Module):
    def __init__(self, config, layer_number):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.attention = SelfAttention(
            config.hidden_size, config.num_attention_heads, layer_number,
            head_minor_keys=(layer_number in config.head_minor_key_layers),
        )
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.mlp = MLP(config.hidden_size)

    def forward(self, hidden_states, attention_mask):
        layernorm_output = self.input_layernorm(hidden_states)
        attention_output = self.attention(layernorm_output, attention_mask)
        layernorm_input = hidden_states + attention_output
        layernorm_output = self.post_attention_layernorm(layernorm_input)
        return layernorm_input + self.mlp(layernorm_output)


class Transformer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList([TransformerLayer(config, i) for i in range(config.num_layers)])
        self.final_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)

    def forward(self, hidden_states, attention_mask):
        hidden_states = hidden_states.transpose(0, 1).contiguous()  # [b, s, h] -> [s, b, h]
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask)
        hidden_states = hidden_states.transpose(0, 1).contiguous()
        return self.final_layernorm(hidden_states)


class Embedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)

    def forward(self, input_ids, position_ids):
        return self.word_embeddings(input_ids) + self.position_embeddings(position_ids)


class TransformerLanguageModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embedding = Embedding(config)
        self.transformer = Transformer(config)


class CodeGeeXModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.language_model = TransformerLanguageModel(config)

    def forward(self, input_ids):
        b, s = input_ids.shape
        position_ids = torch.arange(s, device=input_ids.device)[None].expand(b, -1)
        attention_mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=input_ids.device), diagonal=1)
        hidden = self.language_model.embedding(input_ids, position_ids)
        hidden = self.language_model.transformer(hidden, attention_mask[None, None])
        return F.linear(hidden, self.language_model.embedding.word_embeddings.weight)



def make_model():
    torch.manual_seed(2206)
    config = SimpleNamespace(
        vocab_size=96, hidden_size=64, num_attention_heads=4, num_layers=3, max_position_embeddings=64,
        layernorm_epsilon=1e-5, head_minor_key_layers=(1,),
    )
    model = CodeGeeXModel(config)
    g = torch.Generator().manual_seed(22061)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model.eval()

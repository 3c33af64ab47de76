"""THUDM/SwissArmyTransformer (sat) BaseModel with the GPT-2 settings, in plain torch.

sat's BaseTransformer: `transformer.word_embeddings`, `transformer.position_embeddings` (learned),
`transformer.layers.N` (BaseTransformerLayer: `input_layernorm`, `attention` = SelfAttention with a
fused `query_key_value` Linear and `dense`, `post_attention_layernorm`, `mlp` with
`dense_h_to_4h`/`dense_4h_to_h`), `transformer.final_layernorm`; logits against the word embeddings.
Every layer routes its attention through the model's hook table, as sat's mixins do: the default
`attention_fn` hook is `standard_attention`, which divides the query by sqrt(head_dim) before the
matmul and applies the float (1, 1, s, s) lower-triangular mask multiplicatively:
scores * mask - 10000 * (1 - mask).  The layout is (b, heads, s, d) after `_transpose_for_scores`.
No cache (sat's `mems` path is not used).  Correct.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": ["transformer.layers.0.attention", "transformer.layers.1.attention"],
    "kind": "causal-multihead",
    "cache": None,
    "style": "SwissArmyTransformer BaseModel (GPT-2 config): fused query_key_value + dense, learned positions, "
    "hook table with attention_fn = standard_attention (q / sqrt(d), scores*mask - 10000*(1-mask)), "
    "tied word_embeddings output",
}


def standard_attention(query_layer, key_layer, value_layer, attention_mask, scaling_attention_score=True):
    if scaling_attention_score:
        query_layer = query_layer / math.sqrt(query_layer.shape[-1])
    attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
    if not (attention_mask.shape[-2] == 1 and (attention_mask > 0).all()):
        attention_scores = torch.mul(attention_scores, attention_mask) - 10000.0 * (1.0 - attention_mask)
    attention_probs = F.softmax(attention_scores, dim=-1)
    return torch.matmul(attention_probs, value_layer)


def attention_fn_default(query_layer, key_layer, value_layer, attention_mask, **kw_args):
    return standard_attention(query_layer, key_layer, value_layer, attention_mask)


class SelfAttention(nn.Module):
    def __init__(self, hidden_size, num_attention_heads, layer_id, transformer_pointer):
        super().__init__()
        self.layer_id = layer_id
        self.num_attention_heads = num_attention_heads
        self.hidden_size_per_attention_head = hidden_size // num_attention_heads
        self.query_key_value = nn.Linear(hidden_size, 3 * hidden_size)
        self.dense = nn.Linear(hidden_size, hidden_size)
        object.__setattr__(self, "transformer", transformer_pointer)

    def _transpose_for_scores(self, tensor):
        new_shape = tensor.size()[:-1] + (self.num_attention_heads, self.hidden_size_per_attention_head)
        return tensor.view(*new_shape).permute(0, 2, 1, 3)

    def forward(self, hidden_states, mask, **kw_args):
        attention_fn = self.transformer.hooks.get("attention_fn", attention_fn_default)
        mixed_raw_layer = self.query_key_value(hidden_states)
        mixed_query_layer, mixed_key_layer, mixed_value_layer = torch.chunk(mixed_raw_layer, 3, dim=-1)
        query_layer = self._transpose_for_scores(mixed_query_layer)
        key_layer = self._transpose_for_scores(mixed_key_layer)
        value_layer = self._transpose_for_scores(mixed_value_layer)
        context_layer = attention_fn(query_layer, key_layer, value_layer, mask, **kw_args)
        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        new_shape = context_layer.size()[:-2] + (context_layer.shape[-2] * context_layer.shape[-1],)
        return self.dense(context_layer.view(*new_shape))


class MLP(nn.Module):
    def __init__(self, hidden_size, inner_hidden_size):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(hidden_size, inner_hidden_size)
        self.dense_4h_to_h = nn.Linear(inner_hidden_size, hidden_size)

    def forward(self, hidden_states):
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(hidden_states), approximate="tanh"))


class BaseTransformerLayer(nn.Module):
    def __init__(self, args, layer_id, transformer_pointer):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(args.hidden_size, eps=args.layernorm_epsilon)
        self.attention = SelfAttention(args.hidden_size, args.num_attention_heads, layer_id, transformer_pointer)
        self.post_attention_layernorm = nn.LayerNorm(args.hidden_size, eps=args.layernorm_epsilon)
        self.mlp = MLP(args.hidden_size, args.inner_hidden_size)

    def forward(self, hidden_states, mask, **kw_args):
        attention_input = self.input_layernorm(hidden_states)
        attention_output = self.attention(attention_input, mask, **kw_args)
        hidden_states = hidden_states + attention_output
        mlp_input = self.post_attention_layernorm(hidden_states)
        return hidden_states + self.mlp(mlp_input)


class BaseTransformer(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.hooks = {}
        self.word_embeddings = nn.Embedding(args.vocab_size, args.hidden_size)
        self.position_embeddings = nn.Embedding(args.max_sequence_length, args.hidden_size)
        self.layers = nn.ModuleList([BaseTransformerLayer(args, i, self) for i in range(args.num_layers)])
        self.final_layernorm = nn.LayerNorm(args.hidden_size, eps=args.layernorm_epsilon)

    def forward(self, input_ids, position_ids, attention_mask):
        hidden_states = self.word_embeddings(input_ids) + self.position_embeddings(position_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask)
        logits = self.final_layernorm(hidden_states)
        return F.linear(logits, self.word_embeddings.weight)


class BaseModel(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.transformer = BaseTransformer(args)
        self.transformer.hooks["attention_fn"] = attention_fn_default

    def forward(self, input_ids):
        b, s = input_ids.shape
        position_ids = torch.arange(s, device=input_ids.device)[None].expand(b, -1)
        dtype = self.transformer.word_embeddings.weight.dtype
        attention_mask = torch.ones(s, s, dtype=dtype, device=input_ids.device).tril()[None, None]
        return self.transformer(input_ids, position_ids, attention_mask)


def make_model():
    torch.manual_seed(2204)
    args = SimpleNamespace(
        vocab_size=96, hidden_size=64, num_layers=2, num_attention_heads=4, inner_hidden_size=256,
        max_sequence_length=64, layernorm_epsilon=1e-5,
    )
    model = BaseModel(args)
    g = torch.Generator().manual_seed(22041)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model.eval()

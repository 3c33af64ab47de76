"""alpa-projects/alpa OPT (examples/llm_serving/model/opt_model.py, Flax) ported to PyTorch.

The Flax module tree is kept: OPTForLMModule -> `transformers` (OPTTransformerModule: `embeddings`,
`encoder`, `layer_norm`) -> `encoder.layers.N` (OPTTransformerLayer: `attention`, `ffn`).  Flax Dense
layers are `Dense` modules with an (in, out) `kernel` and a `bias`.  OPTEmbeddings: `word_embeddings`
and learned `position_embeddings` read at position + 2 (OPT's offset).  The attention is pre-LN,
split the way alpa (and BERT) split it: OPTAttention holds `layer_norm`, `self` (OPTSelfAttention) and
the `dense` output layer plus the residual; OPTSelfAttention has one `qkv_combined` Dense whose output is
reshaped to (b, s, heads, head_dim, 3) and split on the last axis (alpa's layout), the query divided
by sqrt(head_dim), scores with `einsum("...qhd,...khd->...hqk")`, an additive causal bias (0 /
finfo.min) from the mask, softmax, `einsum("...hqk,...khd->...qhd")` and returns the merged heads (the attention layer is
`attention.self`, whose output projection lives in its parent, as in BERT).  OPTFFNModule: `layer_norm`, `fc1`, relu, `fc2`, residual.  Tied output projection.
Slip: layer 2's attention was rewritten for a key-major kernel and builds its logits with
`einsum("...khd,...qhd->...hqk")` on (query, key) swapped operands, i.e. keys times queries: the
(q, k) entry is the product of key q and query k.  Layers 0 and 1 are exact.
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
        "transformers.encoder.layers.0.attention.self",
        "transformers.encoder.layers.1.attention.self",
        "transformers.encoder.layers.2.attention.self",
    ],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "transformers.encoder.layers.2.attention.self",
    "stage": "scores",
    "mistake": "scores_transposed",
    "style": "alpa opt_model.py (Flax) ported: Dense (in, out) kernels, qkv_combined reshaped (b, s, h, d, 3), "
    "offset-2 learned positions, OPTAttention(layer_norm, self, dense) split with the projection in the parent, finfo.min bias; "
    "layer 2 computes keys . queries",
}


class Dense(nn.Module):
    def __init__(self, in_features, features, use_bias=True):
        super().__init__()
        self.kernel = nn.Parameter(torch.randn(in_features, features) / math.sqrt(in_features))
        self.bias = nn.Parameter(0.02 * torch.randn(features)) if use_bias else None

    def forward(self, x):
        y = x @ self.kernel
        return y + self.bias if self.bias is not None else y


class OPTEmbeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.decoder_input_dim)
        self.position_embeddings = nn.Embedding(config.max_target_positions + 2, config.decoder_embed_dim)

    def forward(self, input_ids, position_ids):
        return self.word_embeddings(input_ids) + self.position_embeddings(position_ids + 2)


class OPTSelfAttention(nn.Module):
    def __init__(self, config, keys_by_queries=False):
        super().__init__()
        self.num_heads = config.decoder_attention_heads
        self.embed_dim = config.decoder_embed_dim
        self.head_dim = self.embed_dim // self.num_heads
        self.keys_by_queries = keys_by_queries
        self.qkv_combined = Dense(self.embed_dim, 3 * self.embed_dim)

    def forward(self, hidden_states, attention_bias):
        b, s, _ = hidden_states.shape
        qkv_combined_states = self.qkv_combined(hidden_states)
        qkv_combined_states = qkv_combined_states.reshape(b, s, self.num_heads, self.head_dim, 3)
        query_states, key_states, value_states = qkv_combined_states.unbind(dim=-1)
        query_states = query_states / math.sqrt(self.head_dim)
        if self.keys_by_queries:
            attn_weights = torch.einsum("...khd,...qhd->...hqk", query_states, key_states)
        else:
            attn_weights = torch.einsum("...qhd,...khd->...hqk", query_states, key_states)
        attn_weights = attn_weights + attention_bias
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_output = torch.einsum("...hqk,...khd->...qhd", attn_weights, value_states)
        return attn_output.reshape(b, s, self.embed_dim)


class OPTAttention(nn.Module):
    def __init__(self, config, keys_by_queries=False):
        super().__init__()
        self.self = OPTSelfAttention(config, keys_by_queries)
        self.dense = Dense(config.decoder_embed_dim, config.decoder_embed_dim)
        self.layer_norm = nn.LayerNorm(config.decoder_embed_dim, eps=1e-5)

    def forward(self, hidden_states, attention_bias):
        residual = hidden_states
        hidden_states = self.layer_norm(hidden_states)
        attn_output = self.self(hidden_states, attention_bias)
        return self.dense(attn_output) + residual


class OPTFFN(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layer_norm = nn.LayerNorm(config.decoder_embed_dim, eps=1e-5)
        self.fc1 = Dense(config.decoder_embed_dim, config.decoder_ffn_embed_dim)
        self.fc2 = Dense(config.decoder_ffn_embed_dim, config.decoder_embed_dim)

    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.fc2(F.relu(self.fc1(self.layer_norm(hidden_states))))
        return hidden_states + residual


class OPTTransformerLayer(nn.Module):
    def __init__(self, config, idx):
        super().__init__()
        self.attention = OPTAttention(config, keys_by_queries=(idx in config.key_major_layers))
        self.ffn = OPTFFN(config)

    def forward(self, hidden_states, attention_bias):
        return self.ffn(self.attention(hidden_states, attention_bias))


class OPTTransformerLayerCollection(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList([OPTTransformerLayer(config, i) for i in range(config.decoder_layers)])

    def forward(self, hidden_states, attention_bias):
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_bias)
        return hidden_states


class OPTTransformerModule(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embeddings = OPTEmbeddings(config)
        self.encoder = OPTTransformerLayerCollection(config)
        self.layer_norm = nn.LayerNorm(config.decoder_embed_dim, eps=1e-5)

    def forward(self, input_ids, position_ids, attention_bias):
        hidden_states = self.embeddings(input_ids, position_ids)
        hidden_states = self.encoder(hidden_states, attention_bias)
        return self.layer_norm(hidden_states)


class OPTForLMModule(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.transformers = OPTTransformerModule(config)

    def forward(self, input_ids):
        b, s = input_ids.shape
        position_ids = torch.arange(s, device=input_ids.device)[None].expand(b, -1)
        dtype = self.transformers.embeddings.word_embeddings.weight.dtype
        causal = torch.ones(s, s, dtype=torch.bool, device=input_ids.device).tril()
        attention_bias = torch.where(
            causal, torch.zeros((), dtype=dtype), torch.full((), torch.finfo(dtype).min, dtype=dtype)
        )[None, None]
        hidden_states = self.transformers(input_ids, position_ids, attention_bias)
        return hidden_states @ self.transformers.embeddings.word_embeddings.weight.T



def make_model():
    torch.manual_seed(2209)
    config = SimpleNamespace(
        vocab_size=96, decoder_input_dim=64, decoder_embed_dim=64, decoder_attention_heads=4,
        decoder_ffn_embed_dim=192, decoder_layers=3, max_target_positions=64, key_major_layers=(2,),
    )
    model = OPTForLMModule(config)
    g = torch.Generator().manual_seed(22091)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model.eval()

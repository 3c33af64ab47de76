"""A tiny DistilBERT-style encoder (modeling_distilbert.py shape): embeddings -> transformer.layer[i]
= TransformerBlock(attention=MultiHeadSelfAttention(q_lin, k_lin, v_lin, out_lin),
sa_layer_norm, ffn, output_layer_norm), post-norm, bidirectional, optional attention_mask.

The config lets each layer pick an attention implementation ("eager" or "packed"); the packed
variant, used from layer 1 on, was meant to save a transpose.

Slip: PackedSelfAttention.shape() views the projection as (bs, n_heads, seq, dim_per_head)
directly instead of (bs, seq, n_heads, dim_per_head) then transposing, so each "head" is a
block of consecutive token/feature values mixed across tokens.  Layer 0 (eager) is right.
"""

import math

import torch
import torch.nn as nn

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": [
        "transformer.layer.0.attention",
        "transformer.layer.1.attention",
        "transformer.layer.2.attention",
    ],
    "kind": "multihead",
    "layer": "transformer.layer.1.attention",
    "stage": "queries",
    "mistake": "heads_split",
    "cache": None,
    "style": "transformers modeling_distilbert.py; slip: a per-layer 'packed' attention subclass reshapes "
    "q/k/v with view(bs, n_heads, -1, dim_per_head) (heads cut from the wrong axis)",
}


class DistilBertConfig:
    vocab_size = 75
    dim = 48
    n_layers = 3
    n_heads = 6
    hidden_dim = 96
    max_position_embeddings = 64
    attention_implementation = ("eager", "packed", "packed")


class Embeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.dim)
        self.LayerNorm = nn.LayerNorm(config.dim, eps=1e-12)

    def forward(self, input_ids):
        seq_length = input_ids.size(1)
        position_ids = torch.arange(seq_length, dtype=torch.long, device=input_ids.device)
        position_ids = position_ids.unsqueeze(0).expand_as(input_ids)
        return self.LayerNorm(
            self.word_embeddings(input_ids) + self.position_embeddings(position_ids)
        )


class MultiHeadSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_heads = config.n_heads
        self.dim = config.dim
        assert self.dim % self.n_heads == 0
        self.q_lin = nn.Linear(config.dim, config.dim)
        self.k_lin = nn.Linear(config.dim, config.dim)
        self.v_lin = nn.Linear(config.dim, config.dim)
        self.out_lin = nn.Linear(config.dim, config.dim)

    def shape(self, x, bs, dim_per_head):
        """separate heads: (bs, seq, dim) -> (bs, n_heads, seq, dim_per_head)"""
        return x.view(bs, -1, self.n_heads, dim_per_head).transpose(1, 2)

    def unshape(self, x, bs, dim_per_head):
        """group heads: (bs, n_heads, seq, dim_per_head) -> (bs, seq, dim)"""
        return x.transpose(1, 2).contiguous().view(bs, -1, self.n_heads * dim_per_head)

    def forward(self, query, key, value, mask=None):
        bs, q_length, dim = query.size()
        k_length = key.size(1)
        dim_per_head = self.dim // self.n_heads

        q = self.shape(self.q_lin(query), bs, dim_per_head)
        k = self.shape(self.k_lin(key), bs, dim_per_head)
        v = self.shape(self.v_lin(value), bs, dim_per_head)

        q = q / math.sqrt(dim_per_head)
        scores = torch.matmul(q, k.transpose(2, 3))
        if mask is not None:
            mask = (mask == 0).view(bs, 1, 1, k_length).expand_as(scores)
            scores = scores.masked_fill(mask, torch.tensor(torch.finfo(scores.dtype).min))
        weights = nn.functional.softmax(scores, dim=-1)
        context = torch.matmul(weights, v)
        context = self.unshape(context, bs, dim_per_head)
        return (self.out_lin(context),)


class PackedSelfAttention(MultiHeadSelfAttention):
    """Same weights and math; skips the transpose when splitting heads."""

    def shape(self, x, bs, dim_per_head):
        return x.contiguous().view(bs, self.n_heads, -1, dim_per_head)


ATTENTION_CLASSES = {"eager": MultiHeadSelfAttention, "packed": PackedSelfAttention}


class FFN(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.lin1 = nn.Linear(config.dim, config.hidden_dim)
        self.lin2 = nn.Linear(config.hidden_dim, config.dim)
        self.activation = nn.GELU()

    def forward(self, x):
        return self.lin2(self.activation(self.lin1(x)))


class TransformerBlock(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.attention = ATTENTION_CLASSES[config.attention_implementation[layer_idx]](config)
        self.sa_layer_norm = nn.LayerNorm(config.dim, eps=1e-12)
        self.ffn = FFN(config)
        self.output_layer_norm = nn.LayerNorm(config.dim, eps=1e-12)

    def forward(self, x, attn_mask=None):
        sa_output = self.attention(x, x, x, attn_mask)[0]
        sa_output = self.sa_layer_norm(sa_output + x)
        ffn_output = self.ffn(sa_output)
        return self.output_layer_norm(ffn_output + sa_output)


class Transformer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layer = nn.ModuleList([TransformerBlock(config, i) for i in range(config.n_layers)])

    def forward(self, x, attn_mask=None):
        hidden_state = x
        for layer_module in self.layer:
            hidden_state = layer_module(hidden_state, attn_mask)
        return hidden_state


class DistilBertModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embeddings = Embeddings(config)
        self.transformer = Transformer(config)

    def forward(self, input_ids, attention_mask=None):
        return self.transformer(self.embeddings(input_ids), attention_mask)


def make_model():
    torch.manual_seed(5150)
    model = DistilBertModel(DistilBertConfig())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn_like(m.weight))
                m.bias.copy_(0.1 * torch.randn_like(m.bias))
    return model.eval()

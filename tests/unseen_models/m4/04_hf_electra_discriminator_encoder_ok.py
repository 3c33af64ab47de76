"""ELECTRA discriminator in the shape of transformers' modeling_electra.py (written from memory).

ElectraModel: embeddings (word + learned absolute position + token type, LayerNorm, dropout) at
embedding_size 32, then `embeddings_project` Linear 32 -> 64 (ELECTRA-small's factorised
embeddings), then `encoder.layer.N` of ElectraLayer: ElectraAttention holds `self`
(ElectraSelfAttention: query/key/value Linear with bias, transpose_for_scores, 1/sqrt(head_dim),
additive extended mask from attention_mask, softmax, no output projection of its own) and
`output` (dense + dropout + LayerNorm(residual)); post-norm like BERT.  The discriminator head
(dense, gelu, dense_prediction) gives one logit per token; forward returns the last hidden states.

4 heads of 16, 3 layers, hidden 64, vocab 120.  Correct; encoder, no cache.
`model(ids)` or `model(ids, attention_mask)`.
"""

import math

import torch
import torch.nn as nn

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": [
        "encoder.layer.0.attention.self",
        "encoder.layer.1.attention.self",
        "encoder.layer.2.attention.self",
    ],
    "kind": "multihead",
    "cache": None,
    "structure": {
        "heads": 4,
        "kv_heads": 4,
        "head_dim": 16,
        "causal": False,
        "cross": False,
        "rope": None,
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "transformers modeling_electra.py: factorised embeddings + embeddings_project, ElectraSelfAttention "
    "without own out-proj, additive extended mask, post-norm",
}


class ElectraConfig:
    vocab_size = 120
    embedding_size = 32
    hidden_size = 64
    num_hidden_layers = 3
    num_attention_heads = 4
    intermediate_size = 128
    max_position_embeddings = 64
    type_vocab_size = 2
    layer_norm_eps = 1e-12


class ElectraEmbeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.embedding_size, padding_idx=0)
        self.position_embeddings = nn.Embedding(
            config.max_position_embeddings, config.embedding_size
        )
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.embedding_size)
        self.LayerNorm = nn.LayerNorm(config.embedding_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(0.1)
        self.register_buffer(
            "position_ids",
            torch.arange(config.max_position_embeddings).expand((1, -1)),
            persistent=False,
        )

    def forward(self, input_ids):
        seq_length = input_ids.shape[1]
        position_ids = self.position_ids[:, :seq_length]
        token_type_ids = torch.zeros_like(input_ids)
        emb = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        emb = emb + self.position_embeddings(position_ids)
        return self.dropout(self.LayerNorm(emb))


class ElectraSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.query = nn.Linear(config.hidden_size, self.all_head_size)
        self.key = nn.Linear(config.hidden_size, self.all_head_size)
        self.value = nn.Linear(config.hidden_size, self.all_head_size)
        self.dropout = nn.Dropout(0.1)

    def transpose_for_scores(self, x):
        new_x_shape = x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)
        return x.view(new_x_shape).permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask=None):
        query_layer = self.transpose_for_scores(self.query(hidden_states))
        key_layer = self.transpose_for_scores(self.key(hidden_states))
        value_layer = self.transpose_for_scores(self.value(hidden_states))
        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        if attention_mask is not None:
            attention_scores = attention_scores + attention_mask
        attention_probs = self.dropout(nn.functional.softmax(attention_scores, dim=-1))
        context_layer = torch.matmul(attention_probs, value_layer)
        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        return context_layer.view(context_layer.size()[:-2] + (self.all_head_size,))


class ElectraSelfOutput(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(0.1)

    def forward(self, hidden_states, input_tensor):
        return self.LayerNorm(self.dropout(self.dense(hidden_states)) + input_tensor)


class ElectraAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self = ElectraSelfAttention(config)
        self.output = ElectraSelfOutput(config)

    def forward(self, hidden_states, attention_mask=None):
        return self.output(self.self(hidden_states, attention_mask), hidden_states)


class ElectraLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention = ElectraAttention(config)
        self.intermediate = nn.Linear(config.hidden_size, config.intermediate_size)
        self.output_dense = nn.Linear(config.intermediate_size, config.hidden_size)
        self.output_LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states, attention_mask=None):
        a = self.attention(hidden_states, attention_mask)
        h = self.output_dense(nn.functional.gelu(self.intermediate(a)))
        return self.output_LayerNorm(h + a)


class ElectraEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layer = nn.ModuleList(ElectraLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, hidden_states, attention_mask=None):
        for layer_module in self.layer:
            hidden_states = layer_module(hidden_states, attention_mask)
        return hidden_states


class ElectraModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embeddings = ElectraEmbeddings(config)
        self.embeddings_project = nn.Linear(config.embedding_size, config.hidden_size)
        self.encoder = ElectraEncoder(config)

    def forward(self, input_ids, attention_mask=None):
        extended = None
        if attention_mask is not None:
            extended = (1.0 - attention_mask[:, None, None, :].float()) * torch.finfo(
                torch.float32
            ).min
        h = self.embeddings_project(self.embeddings(input_ids))
        return self.encoder(h, extended)


def make_model():
    torch.manual_seed(404)
    model = ElectraModel(ElectraConfig())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn_like(m.weight))
                m.bias.copy_(0.1 * torch.randn_like(m.bias))
    return model.eval()

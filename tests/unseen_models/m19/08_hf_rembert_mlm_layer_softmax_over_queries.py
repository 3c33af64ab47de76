"""RemBERT masked LM (transformers modeling_rembert.py, RemBertForMaskedLM).

rembert (RemBertModel: embeddings with a narrow input_embedding_size (32) word table + position +
token_type, LayerNorm; encoder with `embedding_hidden_mapping_in` (32 -> 64) and layer.N), cls
(RemBertOnlyMLMHead: predictions.dense to output_embedding_size (48), activation, LayerNorm,
decoder to the vocabulary).  RemBertLayer is post-norm BERT: attention.self = RemBertSelfAttention
(query/key/value Linears with bias, transpose_for_scores, / sqrt(head_size), additive extended mask,
softmax, no projection of its own), attention.output (dense + LayerNorm(residual)), intermediate,
output.  Bidirectional, MHA 4 x 16, 3 layers.
Slip: layer 1 is a RemBertSelfAttention subclass ported from a (batch, query, head, key) score layout
that normalises over dim=2; in this module's (batch, head, query, key) layout that is the query axis.
No cache (encoder).
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
        "rembert.encoder.layer.0.attention.self",
        "rembert.encoder.layer.1.attention.self",
        "rembert.encoder.layer.2.attention.self",
    ],
    "kind": "multihead",
    "cache": None,
    "layer": "rembert.encoder.layer.1.attention.self",
    "stage": "weights",
    "mistake": "softmax_wrong_dim",
    "style": "modeling_rembert.py MLM: decoupled input/output embedding sizes with embedding_hidden_mapping_in, "
    "post-norm BERT self-attention without own out-proj; layer 1's softmax runs over dim=2 (queries)",
}


class RemBertEmbeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.input_embedding_size,
                                            padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.input_embedding_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.input_embedding_size)
        self.LayerNorm = nn.LayerNorm(config.input_embedding_size, eps=config.layer_norm_eps)
        self.register_buffer("position_ids", torch.arange(config.max_position_embeddings).expand((1, -1)),
                             persistent=False)

    def forward(self, input_ids):
        seq_length = input_ids.shape[1]
        position_ids = self.position_ids[:, :seq_length]
        token_type_ids = torch.zeros_like(input_ids)
        embeddings = (self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
                      + self.position_embeddings(position_ids))
        return self.LayerNorm(embeddings)


class RemBertSelfAttention(nn.Module):
    softmax_dim = -1

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
        return x.view(*new_x_shape).permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask=None):
        query_layer = self.transpose_for_scores(self.query(hidden_states))
        key_layer = self.transpose_for_scores(self.key(hidden_states))
        value_layer = self.transpose_for_scores(self.value(hidden_states))
        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        if attention_mask is not None:
            attention_scores = attention_scores + attention_mask
        attention_probs = F.softmax(attention_scores, dim=self.softmax_dim)
        context_layer = torch.matmul(attention_probs, value_layer)
        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        return context_layer.view(*context_layer.size()[:-2], self.all_head_size)


class RemBertSelfAttentionBQHK(RemBertSelfAttention):
    # ported from a (batch, query, head, key) layout where the key axis was dim 3 and heads dim 2
    softmax_dim = 2


class RemBertSelfOutput(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states, input_tensor):
        return self.LayerNorm(self.dense(hidden_states) + input_tensor)


class RemBertAttention(nn.Module):
    def __init__(self, config, self_cls):
        super().__init__()
        self.self = self_cls(config)
        self.output = RemBertSelfOutput(config)

    def forward(self, hidden_states, attention_mask=None):
        return self.output(self.self(hidden_states, attention_mask), hidden_states)


class RemBertIntermediate(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)

    def forward(self, hidden_states):
        return F.gelu(self.dense(hidden_states))


class RemBertOutput(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.intermediate_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states, input_tensor):
        return self.LayerNorm(self.dense(hidden_states) + input_tensor)


class RemBertLayer(nn.Module):
    def __init__(self, config, self_cls):
        super().__init__()
        self.attention = RemBertAttention(config, self_cls)
        self.intermediate = RemBertIntermediate(config)
        self.output = RemBertOutput(config)

    def forward(self, hidden_states, attention_mask=None):
        attention_output = self.attention(hidden_states, attention_mask)
        return self.output(self.intermediate(attention_output), attention_output)


class RemBertEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embedding_hidden_mapping_in = nn.Linear(config.input_embedding_size, config.hidden_size)
        self.layer = nn.ModuleList(
            [RemBertLayer(config, RemBertSelfAttentionBQHK if i in config.bqhk_layers else RemBertSelfAttention)
             for i in range(config.num_hidden_layers)]
        )

    def forward(self, hidden_states, attention_mask=None):
        hidden_states = self.embedding_hidden_mapping_in(hidden_states)
        for layer_module in self.layer:
            hidden_states = layer_module(hidden_states, attention_mask)
        return hidden_states


class RemBertModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embeddings = RemBertEmbeddings(config)
        self.encoder = RemBertEncoder(config)

    def forward(self, input_ids, attention_mask=None):
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        emb = self.embeddings(input_ids)
        extended = (1.0 - attention_mask[:, None, None, :].to(emb.dtype)) * torch.finfo(emb.dtype).min
        return self.encoder(emb, extended)


class RemBertLMPredictionHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.output_embedding_size)
        self.decoder = nn.Linear(config.output_embedding_size, config.vocab_size)
        self.LayerNorm = nn.LayerNorm(config.output_embedding_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states):
        return self.decoder(self.LayerNorm(F.gelu(self.dense(hidden_states))))


class RemBertOnlyMLMHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.predictions = RemBertLMPredictionHead(config)

    def forward(self, sequence_output):
        return self.predictions(sequence_output)


class RemBertForMaskedLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.rembert = RemBertModel(config)
        self.cls = RemBertOnlyMLMHead(config)

    def forward(self, input_ids, attention_mask=None):
        return self.cls(self.rembert(input_ids, attention_mask))


def make_model():
    torch.manual_seed(1908)
    config = SimpleNamespace(
        vocab_size=96, input_embedding_size=32, output_embedding_size=48, hidden_size=64,
        intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, max_position_embeddings=64,
        type_vocab_size=2, layer_norm_eps=1e-12, pad_token_id=0, bqhk_layers=(1,),
    )
    model = RemBertForMaskedLM(config)
    g = torch.Generator().manual_seed(19081)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model.eval()

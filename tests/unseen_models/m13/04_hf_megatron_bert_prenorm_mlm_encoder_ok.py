"""Megatron-BERT masked LM, after transformers' modeling_megatron_bert.py (MegatronBertForMaskedLM).

bert.embeddings (word, position, token_type; no LayerNorm inside, unlike BERT), bert.encoder.layer.N =
MegatronBertLayer and a final bert.encoder.ln.  Pre-norm: MegatronBertAttention holds `ln`, `self`
(MegatronBertSelfAttention: query/key/value with bias, transpose_for_scores, / sqrt(d), additive
extended mask from the all-ones attention mask, softmax, no output projection of its own) and
`output` (MegatronBertSelfOutput: dense + residual, no norm).  MegatronBertLayer then applies `ln`,
intermediate (GELU) and output (dense + residual).  cls.predictions: transform (dense, GELU, LayerNorm)
and a decoder tied in shape to the embeddings.  Encoder (bidirectional), no cache.  Correct.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": [
        "bert.encoder.layer.0.attention.self",
        "bert.encoder.layer.1.attention.self",
        "bert.encoder.layer.2.attention.self",
    ],
    "kind": "multihead",
    "cache": None,
    "style": "modeling_megatron_bert.py: pre-norm BERT (attention.ln before self, final encoder.ln), embeddings "
    "without LayerNorm, self-attention without its own out-proj, extended additive mask",
}


class MegatronBertEmbeddings(nn.Module):
    def __init__(self, vocab, hidden, max_pos=64):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, hidden)
        self.position_embeddings = nn.Embedding(max_pos, hidden)
        self.token_type_embeddings = nn.Embedding(2, hidden)
        self.dropout = nn.Dropout(0.0)
        self.register_buffer("position_ids", torch.arange(max_pos).expand((1, -1)), persistent=False)

    def forward(self, input_ids):
        seq_length = input_ids.size(1)
        position_ids = self.position_ids[:, :seq_length]
        token_type_ids = torch.zeros_like(input_ids)
        e = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        e = e + self.position_embeddings(position_ids)
        return self.dropout(e)


class MegatronBertSelfAttention(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.num_attention_heads = heads
        self.attention_head_size = hidden // heads
        self.all_head_size = hidden
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.dropout = nn.Dropout(0.0)

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
        context_layer = torch.matmul(attention_probs, value_layer).permute(0, 2, 1, 3).contiguous()
        return context_layer.view(context_layer.size()[:-2] + (self.all_head_size,))


class MegatronBertSelfOutput(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.dropout = nn.Dropout(0.0)

    def forward(self, hidden_states, residual):
        return residual + self.dropout(self.dense(hidden_states))


class MegatronBertAttention(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.ln = nn.LayerNorm(hidden, eps=1e-12)
        self.self = MegatronBertSelfAttention(hidden, heads)
        self.output = MegatronBertSelfOutput(hidden)

    def forward(self, hidden_states, attention_mask=None):
        ln_outputs = self.ln(hidden_states)
        self_outputs = self.self(ln_outputs, attention_mask)
        return self.output(self_outputs, hidden_states)


class MegatronBertLayer(nn.Module):
    def __init__(self, hidden, heads, inter):
        super().__init__()
        self.attention = MegatronBertAttention(hidden, heads)
        self.ln = nn.LayerNorm(hidden, eps=1e-12)
        self.intermediate = nn.Linear(hidden, inter)
        self.output = nn.Linear(inter, hidden)

    def forward(self, hidden_states, attention_mask=None):
        attention_output = self.attention(hidden_states, attention_mask)
        h = F.gelu(self.intermediate(self.ln(attention_output)))
        return attention_output + self.output(h)


class MegatronBertEncoder(nn.Module):
    def __init__(self, hidden, heads, inter, n_layers):
        super().__init__()
        self.layer = nn.ModuleList([MegatronBertLayer(hidden, heads, inter) for _ in range(n_layers)])
        self.ln = nn.LayerNorm(hidden, eps=1e-12)

    def forward(self, hidden_states, attention_mask=None):
        for layer_module in self.layer:
            hidden_states = layer_module(hidden_states, attention_mask)
        return self.ln(hidden_states)


class MegatronBertModel(nn.Module):
    def __init__(self, vocab, hidden, heads, inter, n_layers):
        super().__init__()
        self.embeddings = MegatronBertEmbeddings(vocab, hidden)
        self.encoder = MegatronBertEncoder(hidden, heads, inter, n_layers)

    def forward(self, input_ids):
        attention_mask = torch.ones_like(input_ids)
        dtype = self.embeddings.word_embeddings.weight.dtype
        extended = (1.0 - attention_mask[:, None, None, :].to(dtype)) * torch.finfo(dtype).min
        return self.encoder(self.embeddings(input_ids), extended)


class MegatronBertForMaskedLM(nn.Module):
    def __init__(self, vocab=96, hidden=64, heads=4, inter=128, n_layers=3):
        super().__init__()
        self.bert = MegatronBertModel(vocab, hidden, heads, inter, n_layers)
        self.cls = nn.ModuleDict(dict(
            transform=nn.Linear(hidden, hidden), transform_ln=nn.LayerNorm(hidden, eps=1e-12),
            decoder=nn.Linear(hidden, vocab)))

    def forward(self, input_ids):
        h = self.bert(input_ids)
        h = self.cls["transform_ln"](F.gelu(self.cls["transform"](h)))
        return self.cls["decoder"](h)


def make_model():
    torch.manual_seed(1304)
    model = MegatronBertForMaskedLM()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.2 * torch.randn_like(m.weight))
                m.bias.copy_(0.05 * torch.randn_like(m.bias))
    return model.eval()

"""RoBERTa-PreLayerNorm (transformers' modeling_roberta_prelayernorm.py) masked LM, reduced.

RobertaPreLayerNormForMaskedLM: roberta_prelayernorm (embeddings: word/position/token_type, no
embedding LayerNorm use in the pre-norm variant, positions offset by padding_idx + 1; encoder.layer.N;
LayerNorm at the end) and lm_head (dense, gelu, layer_norm, decoder).  Each layer: attention
(RobertaPreLayerNormAttention: LayerNorm *before* self, self = query/key/value with bias and
transpose_for_scores, output.dense + residual), intermediate (LayerNorm then dense + gelu), output.
The self-attention module has no out-projection of its own (it lives in attention.output.dense).
Bidirectional, no mask (all tokens valid).  No cache.  Correct (encoder).
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": [
        "roberta_prelayernorm.encoder.layer.0.attention.self",
        "roberta_prelayernorm.encoder.layer.1.attention.self",
        "roberta_prelayernorm.encoder.layer.2.attention.self",
    ],
    "kind": "multihead",
    "cache": None,
    "style": "modeling_roberta_prelayernorm.py MLM: LayerNorm before attention.self, transpose_for_scores, "
    "out-projection in attention.output.dense, positions offset padding_idx + 1, final encoder LayerNorm",
}


class Embeddings(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.word_embeddings = nn.Embedding(c["vocab_size"], c["hidden_size"], padding_idx=c["pad_token_id"])
        self.position_embeddings = nn.Embedding(c["max_position_embeddings"], c["hidden_size"])
        self.token_type_embeddings = nn.Embedding(1, c["hidden_size"])
        self.padding_idx = c["pad_token_id"]

    def forward(self, input_ids):
        seq_len = input_ids.shape[1]
        position_ids = torch.arange(self.padding_idx + 1, self.padding_idx + 1 + seq_len)[None].expand_as(input_ids)
        token_type_ids = torch.zeros_like(input_ids)
        return (self.word_embeddings(input_ids) + self.position_embeddings(position_ids)
                + self.token_type_embeddings(token_type_ids))


class SelfAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.num_attention_heads = c["num_attention_heads"]
        self.attention_head_size = c["hidden_size"] // c["num_attention_heads"]
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.query = nn.Linear(c["hidden_size"], self.all_head_size)
        self.key = nn.Linear(c["hidden_size"], self.all_head_size)
        self.value = nn.Linear(c["hidden_size"], self.all_head_size)

    def transpose_for_scores(self, x):
        new_x_shape = x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)
        return x.view(new_x_shape).permute(0, 2, 1, 3)

    def forward(self, hidden_states):
        query_layer = self.transpose_for_scores(self.query(hidden_states))
        key_layer = self.transpose_for_scores(self.key(hidden_states))
        value_layer = self.transpose_for_scores(self.value(hidden_states))
        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        attention_probs = nn.functional.softmax(attention_scores, dim=-1)
        context_layer = torch.matmul(attention_probs, value_layer)
        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        return context_layer.view(context_layer.size()[:-2] + (self.all_head_size,))


class SelfOutput(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.dense = nn.Linear(c["hidden_size"], c["hidden_size"])

    def forward(self, hidden_states, input_tensor):
        return self.dense(hidden_states) + input_tensor


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.self = SelfAttention(c)
        self.output = SelfOutput(c)
        self.LayerNorm = nn.LayerNorm(c["hidden_size"], eps=c["layer_norm_eps"])

    def forward(self, hidden_states):
        return self.output(self.self(self.LayerNorm(hidden_states)), hidden_states)


class Intermediate(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.LayerNorm = nn.LayerNorm(c["hidden_size"], eps=c["layer_norm_eps"])
        self.dense = nn.Linear(c["hidden_size"], c["intermediate_size"])

    def forward(self, h):
        return F.gelu(self.dense(self.LayerNorm(h)))


class Output(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.dense = nn.Linear(c["intermediate_size"], c["hidden_size"])

    def forward(self, h, input_tensor):
        return self.dense(h) + input_tensor


class Layer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.attention = Attention(c)
        self.intermediate = Intermediate(c)
        self.output = Output(c)

    def forward(self, h):
        a = self.attention(h)
        return self.output(self.intermediate(a), a)


class Encoder(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.layer = nn.ModuleList(Layer(c) for _ in range(c["num_hidden_layers"]))

    def forward(self, h):
        for layer in self.layer:
            h = layer(h)
        return h


class RobertaPreLayerNormModel(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embeddings = Embeddings(c)
        self.encoder = Encoder(c)
        self.LayerNorm = nn.LayerNorm(c["hidden_size"], eps=c["layer_norm_eps"])

    def forward(self, input_ids):
        return self.LayerNorm(self.encoder(self.embeddings(input_ids)))


class LMHead(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.dense = nn.Linear(c["hidden_size"], c["hidden_size"])
        self.layer_norm = nn.LayerNorm(c["hidden_size"], eps=c["layer_norm_eps"])
        self.decoder = nn.Linear(c["hidden_size"], c["vocab_size"])

    def forward(self, h):
        return self.decoder(self.layer_norm(F.gelu(self.dense(h))))


class RobertaPreLayerNormForMaskedLM(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.roberta_prelayernorm = RobertaPreLayerNormModel(c)
        self.lm_head = LMHead(c)

    def forward(self, input_ids):
        return self.lm_head(self.roberta_prelayernorm(input_ids))


def make_model():
    torch.manual_seed(1404)
    c = dict(vocab_size=96, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=128,
             max_position_embeddings=72, pad_token_id=1, layer_norm_eps=1e-5)
    model = RobertaPreLayerNormForMaskedLM(c)
    g = torch.Generator().manual_seed(14041)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model.eval()

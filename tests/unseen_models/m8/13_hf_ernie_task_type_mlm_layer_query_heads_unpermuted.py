"""ERNIE masked-LM encoder, after transformers' modeling_ernie.py (ERNIE 3.0 style config).

ErnieForMaskedLM: ernie.embeddings (word_embeddings, position_embeddings from a position_ids buffer,
token_type_embeddings, task_type_embeddings (use_task_id True), LayerNorm), ernie.encoder.layer.N
(ErnieLayer: attention = ErnieAttention(self = ErnieSelfAttention, output = ErnieSelfOutput with
dense + LayerNorm post-norm), intermediate, output), cls.predictions (transform dense/gelu/LayerNorm,
decoder tied to the word embeddings, bias).  ErnieSelfAttention has query/key/value with bias and no
output projection of its own (it lives in attention.output.dense); scores / sqrt(head_dim), the
extended additive mask (1 - mask) * finfo.min from an all-ones attention mask, softmax, context.
The forward takes `input_ids` and optional token_type_ids / task_type_ids (zeros by default; the
model's make_model() token types are all 0, so they add a constant row).  MLM logits in `.logits`.
Slip: layer 2's self-attention is `ErnieSelfAttentionFast`, whose query split was "optimised" to
`x.view(b, heads, seq, head_dim)` (a bare reshape of the (b, seq, hidden) projection, no transpose),
so each query "head" holds a slice of tokens and features mixed.  Keys and values are split right.
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
        "ernie.encoder.layer.0.attention.self",
        "ernie.encoder.layer.1.attention.self",
        "ernie.encoder.layer.2.attention.self",
    ],
    "kind": "multihead",
    "cache": None,
    "layer": "ernie.encoder.layer.2.attention.self",
    "stage": "queries",
    "mistake": "heads_split",
    "style": "modeling_ernie.py MLM: word/position/token_type/task_type embeddings, ErnieSelfAttention (no own out-proj, "
    "ErnieSelfOutput post-norm), extended finfo.min mask, tied cls.predictions decoder; layer 2's query heads are "
    "a bare view(b, heads, seq, hd) of the projection (no transpose)",
}


class ErnieEmbeddings(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.word_embeddings = nn.Embedding(c.vocab_size, c.hidden_size, padding_idx=c.pad_token_id)
        self.position_embeddings = nn.Embedding(c.max_position_embeddings, c.hidden_size)
        self.token_type_embeddings = nn.Embedding(c.type_vocab_size, c.hidden_size)
        self.task_type_embeddings = nn.Embedding(c.task_type_vocab_size, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.register_buffer(
            "position_ids",
            torch.arange(c.max_position_embeddings).expand((1, -1)),
            persistent=False,
        )

    def forward(self, input_ids, token_type_ids=None, task_type_ids=None):
        seq_length = input_ids.shape[1]
        position_ids = self.position_ids[:, :seq_length]
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        if task_type_ids is None:
            task_type_ids = torch.zeros_like(input_ids)
        embeddings = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        embeddings = embeddings + self.position_embeddings(position_ids)
        embeddings = embeddings + self.task_type_embeddings(task_type_ids)
        return self.LayerNorm(embeddings)


class ErnieSelfAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.num_attention_heads = c.num_attention_heads
        self.attention_head_size = c.hidden_size // c.num_attention_heads
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.query = nn.Linear(c.hidden_size, self.all_head_size)
        self.key = nn.Linear(c.hidden_size, self.all_head_size)
        self.value = nn.Linear(c.hidden_size, self.all_head_size)

    def transpose_for_scores(self, x):
        new_x_shape = x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)
        return x.view(new_x_shape).permute(0, 2, 1, 3)

    def split_query(self, x):
        return self.transpose_for_scores(x)

    def forward(self, hidden_states, attention_mask=None):
        query_layer = self.split_query(self.query(hidden_states))
        key_layer = self.transpose_for_scores(self.key(hidden_states))
        value_layer = self.transpose_for_scores(self.value(hidden_states))
        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        if attention_mask is not None:
            attention_scores = attention_scores + attention_mask
        attention_probs = F.softmax(attention_scores, dim=-1)
        context_layer = torch.matmul(attention_probs, value_layer).permute(0, 2, 1, 3).contiguous()
        context_layer = context_layer.view(context_layer.size()[:-2] + (self.all_head_size,))
        return (context_layer,)


class ErnieSelfAttentionFast(ErnieSelfAttention):
    def split_query(self, x):
        b, s, _ = x.shape
        return x.view(b, self.num_attention_heads, s, self.attention_head_size)


class ErnieSelfOutput(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, hidden_states, input_tensor):
        return self.LayerNorm(self.dense(hidden_states) + input_tensor)


class ErnieAttention(nn.Module):
    def __init__(self, c, fast=False):
        super().__init__()
        self.self = (ErnieSelfAttentionFast if fast else ErnieSelfAttention)(c)
        self.output = ErnieSelfOutput(c)

    def forward(self, hidden_states, attention_mask=None):
        self_outputs = self.self(hidden_states, attention_mask)
        return self.output(self_outputs[0], hidden_states)


class ErnieLayer(nn.Module):
    def __init__(self, c, layer_idx):
        super().__init__()
        self.attention = ErnieAttention(c, fast=layer_idx in c.fast_query_layers)
        self.intermediate = nn.Linear(c.hidden_size, c.intermediate_size)
        self.output_dense = nn.Linear(c.intermediate_size, c.hidden_size)
        self.output_LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, hidden_states, attention_mask=None):
        attention_output = self.attention(hidden_states, attention_mask)
        inter = F.gelu(self.intermediate(attention_output))
        return self.output_LayerNorm(self.output_dense(inter) + attention_output)


class ErnieEncoder(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.layer = nn.ModuleList([ErnieLayer(c, i) for i in range(c.num_hidden_layers)])

    def forward(self, hidden_states, attention_mask=None):
        for layer_module in self.layer:
            hidden_states = layer_module(hidden_states, attention_mask)
        return hidden_states


class ErnieModel(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embeddings = ErnieEmbeddings(c)
        self.encoder = ErnieEncoder(c)

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, task_type_ids=None):
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        embedding_output = self.embeddings(input_ids, token_type_ids, task_type_ids)
        dtype = embedding_output.dtype
        extended = (1.0 - attention_mask[:, None, None, :].to(dtype)) * torch.finfo(dtype).min
        return self.encoder(embedding_output, extended)


class ErnieLMPredictionHead(nn.Module):
    def __init__(self, c, word_embeddings):
        super().__init__()
        self.transform_dense = nn.Linear(c.hidden_size, c.hidden_size)
        self.transform_LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.decoder = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.decoder.weight = word_embeddings.weight
        self.bias = nn.Parameter(torch.zeros(c.vocab_size))

    def forward(self, h):
        h = self.transform_LayerNorm(F.gelu(self.transform_dense(h)))
        return self.decoder(h) + self.bias


class ErnieOnlyMLMHead(nn.Module):
    def __init__(self, c, word_embeddings):
        super().__init__()
        self.predictions = ErnieLMPredictionHead(c, word_embeddings)


class ErnieForMaskedLM(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.ernie = ErnieModel(c)
        self.cls = ErnieOnlyMLMHead(c, self.ernie.embeddings.word_embeddings)

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, task_type_ids=None):
        seq = self.ernie(input_ids, attention_mask, token_type_ids, task_type_ids)
        return SimpleNamespace(logits=self.cls.predictions(seq))


def make_model():
    torch.manual_seed(813)
    c = SimpleNamespace(
        vocab_size=150,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
        type_vocab_size=2,
        task_type_vocab_size=3,
        layer_norm_eps=1e-12,
        pad_token_id=0,
        fast_query_layers=(2,),
    )
    model = ErnieForMaskedLM(c)
    g = torch.Generator().manual_seed(8131)
    with torch.no_grad():
        model.cls.predictions.bias.copy_(0.1 * torch.randn(c.vocab_size, generator=g))
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model.eval()

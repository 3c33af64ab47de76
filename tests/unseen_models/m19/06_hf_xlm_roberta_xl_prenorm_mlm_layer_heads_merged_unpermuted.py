"""XLM-RoBERTa-XL masked LM (transformers modeling_xlm_roberta_xl.py, XLMRobertaXLForMaskedLM).

roberta (XLMRobertaXLModel: embeddings = word + position (ids from the non-pad cumsum, offset
padding_idx + 1) + token_type, no embedding LayerNorm; encoder.layer.N; encoder.LayerNorm at the end),
lm_head (dense, gelu, layer_norm, decoder + bias).  XLMRobertaXLLayer is pre-norm:
attention = XLMRobertaXLAttention(self_attn_layer_norm -> self -> output.dense + residual), then
LayerNorm -> intermediate (dense + gelu) -> output (dense + residual).  XLMRobertaXLSelfAttention:
query/key/value Linears with bias, transpose_for_scores, / sqrt(head_size), additive extended padding
mask (all zeros here), softmax, context permuted back and flattened; no projection of its own (that is
XLMRobertaXLSelfOutput.dense).  Bidirectional, MHA 4 x 16, 3 layers.
Slip: layer 2 uses a "fast merge" self-attention subclass that flattens the context straight from
(b, heads, seq, head_size) with .view(b, seq, all_head_size), without the permute(0, 2, 1, 3).
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
        "roberta.encoder.layer.0.attention.self",
        "roberta.encoder.layer.1.attention.self",
        "roberta.encoder.layer.2.attention.self",
    ],
    "kind": "multihead",
    "cache": None,
    "layer": "roberta.encoder.layer.2.attention.self",
    "stage": "output",
    "mistake": "heads_merge",
    "style": "modeling_xlm_roberta_xl.py MLM: pre-norm self_attn_layer_norm, BERT self-attention without its own "
    "out-proj, padding-offset positions, final encoder LayerNorm; layer 2 flattens (b, h, s, d) context "
    "without permuting heads back",
}


def create_position_ids_from_input_ids(input_ids, padding_idx):
    mask = input_ids.ne(padding_idx).int()
    incremental_indices = torch.cumsum(mask, dim=1).type_as(mask) * mask
    return incremental_indices.long() + padding_idx


class XLMRobertaXLEmbeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size,
                                                padding_idx=config.pad_token_id)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.padding_idx = config.pad_token_id

    def forward(self, input_ids):
        position_ids = create_position_ids_from_input_ids(input_ids, self.padding_idx)
        token_type_ids = torch.zeros_like(input_ids)
        return (self.word_embeddings(input_ids) + self.position_embeddings(position_ids)
                + self.token_type_embeddings(token_type_ids))


class XLMRobertaXLSelfAttention(nn.Module):
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
        return x.view(new_x_shape).permute(0, 2, 1, 3)

    def merge_heads(self, context_layer):
        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        return context_layer.view(context_layer.size()[:-2] + (self.all_head_size,))

    def forward(self, hidden_states, attention_mask=None):
        query_layer = self.transpose_for_scores(self.query(hidden_states))
        key_layer = self.transpose_for_scores(self.key(hidden_states))
        value_layer = self.transpose_for_scores(self.value(hidden_states))
        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        if attention_mask is not None:
            attention_scores = attention_scores + attention_mask
        attention_probs = F.softmax(attention_scores, dim=-1)
        context_layer = torch.matmul(attention_probs, value_layer)
        return self.merge_heads(context_layer)


class XLMRobertaXLSelfAttentionFastMerge(XLMRobertaXLSelfAttention):
    def merge_heads(self, context_layer):
        b, h, s, d = context_layer.shape
        return context_layer.contiguous().view(b, s, h * d)


class XLMRobertaXLSelfOutput(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden_states, input_tensor):
        return self.dense(hidden_states) + input_tensor


class XLMRobertaXLAttention(nn.Module):
    def __init__(self, config, self_cls):
        super().__init__()
        self.self_attn_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self = self_cls(config)
        self.output = XLMRobertaXLSelfOutput(config)

    def forward(self, hidden_states, attention_mask=None):
        intermediate = self.self_attn_layer_norm(hidden_states)
        return self.output(self.self(intermediate, attention_mask), hidden_states)


class XLMRobertaXLIntermediate(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)

    def forward(self, hidden_states):
        return F.gelu(self.dense(hidden_states))


class XLMRobertaXLOutput(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, hidden_states, input_tensor):
        return self.dense(hidden_states) + input_tensor


class XLMRobertaXLLayer(nn.Module):
    def __init__(self, config, self_cls):
        super().__init__()
        self.attention = XLMRobertaXLAttention(config, self_cls)
        self.intermediate = XLMRobertaXLIntermediate(config)
        self.output = XLMRobertaXLOutput(config)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states, attention_mask=None):
        attention_output = self.attention(hidden_states, attention_mask)
        intermediate_output = self.intermediate(self.LayerNorm(attention_output))
        return self.output(intermediate_output, attention_output)


class XLMRobertaXLEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layer = nn.ModuleList(
            [XLMRobertaXLLayer(config, XLMRobertaXLSelfAttentionFastMerge if i in config.fast_merge_layers
                               else XLMRobertaXLSelfAttention) for i in range(config.num_hidden_layers)]
        )
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states, attention_mask=None):
        for layer_module in self.layer:
            hidden_states = layer_module(hidden_states, attention_mask)
        return self.LayerNorm(hidden_states)


class XLMRobertaXLModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embeddings = XLMRobertaXLEmbeddings(config)
        self.encoder = XLMRobertaXLEncoder(config)

    def forward(self, input_ids, attention_mask=None):
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        emb = self.embeddings(input_ids)
        extended = (1.0 - attention_mask[:, None, None, :].to(emb.dtype)) * torch.finfo(emb.dtype).min
        return self.encoder(emb, extended)


class XLMRobertaXLLMHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size)

    def forward(self, features):
        return self.decoder(self.layer_norm(F.gelu(self.dense(features))))


class XLMRobertaXLForMaskedLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.roberta = XLMRobertaXLModel(config)
        self.lm_head = XLMRobertaXLLMHead(config)

    def forward(self, input_ids, attention_mask=None):
        return self.lm_head(self.roberta(input_ids, attention_mask))


def make_model():
    torch.manual_seed(1906)
    config = SimpleNamespace(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        max_position_embeddings=72, type_vocab_size=1, layer_norm_eps=1e-5, pad_token_id=1,
        fast_merge_layers=(2,),
    )
    model = XLMRobertaXLForMaskedLM(config)
    g = torch.Generator().manual_seed(19061)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model.eval()

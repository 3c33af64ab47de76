"""BLIP's text decoder used as a plain causal LM (transformers modeling_blip_text.py,
BlipTextLMHeadModel; the same med.py BERT-as-decoder that BLIP/ALBEF ship), image cross-attention not
built (no encoder_hidden_states, so BlipTextLayer has no `crossattention`).

bert (BlipTextModel: embeddings = word_embeddings + absolute position_embeddings sliced from a
position_ids buffer at [past_key_values_length : past + seq], then LayerNorm; encoder.layer.N) and cls
(BlipTextOnlyMLMHead: predictions.transform dense/gelu/LayerNorm, predictions.decoder with bias).
BlipTextLayer is post-norm BERT: attention (self = BlipTextSelfAttention with query/key/value Linears
with bias and no projection of its own; output = BlipTextSelfOutput dense + LayerNorm(residual)),
intermediate (dense + gelu), output (dense + LayerNorm).  The decoder mask is built the BERT way
(`get_extended_attention_mask` with is_decoder: seq_ids <= seq_ids, ones prepended for the past,
(1 - mask) * finfo.min).  MHA 4 x 16.
Cache: hf tuples (key, value) per layer in (b, h, s, d), concatenated on dim 2:
`out = model(ids, use_cache=True)`, `model(tok, past_key_values=out.past_key_values, use_cache=True)`;
logits in `out.logits`.  Correct.
"""

import math
from types import SimpleNamespace

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
    "kind": "causal-multihead",
    "cache": "hf",
    "style": "modeling_blip_text.py BlipTextLMHeadModel: BERT post-norm decoder, learned absolute positions "
    "offset by the past length, BlipTextSelfAttention (query/key/value, transpose_for_scores, no own "
    "out-proj), extended causal mask with ones for the past, legacy (k, v) tuples",
}


class BlipTextEmbeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.register_buffer(
            "position_ids", torch.arange(config.max_position_embeddings).expand((1, -1)), persistent=False
        )

    def forward(self, input_ids, past_key_values_length=0):
        seq_length = input_ids.size(1)
        position_ids = self.position_ids[:, past_key_values_length : seq_length + past_key_values_length]
        embeddings = self.word_embeddings(input_ids) + self.position_embeddings(position_ids)
        return self.LayerNorm(embeddings)


class BlipTextSelfAttention(nn.Module):
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

    def forward(self, hidden_states, attention_mask=None, past_key_value=None):
        mixed_query_layer = self.query(hidden_states)
        key_layer = self.transpose_for_scores(self.key(hidden_states))
        value_layer = self.transpose_for_scores(self.value(hidden_states))
        if past_key_value is not None:
            key_layer = torch.cat([past_key_value[0], key_layer], dim=2)
            value_layer = torch.cat([past_key_value[1], value_layer], dim=2)
        query_layer = self.transpose_for_scores(mixed_query_layer)
        past_key_value = (key_layer, value_layer)
        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        if attention_mask is not None:
            attention_scores = attention_scores + attention_mask.to(attention_scores.dtype)
        attention_probs = nn.Softmax(dim=-1)(attention_scores)
        context_layer = torch.matmul(attention_probs, value_layer)
        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        new_context_layer_shape = context_layer.size()[:-2] + (self.all_head_size,)
        context_layer = context_layer.view(*new_context_layer_shape)
        return context_layer, past_key_value


class BlipTextSelfOutput(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states, input_tensor):
        return self.LayerNorm(self.dense(hidden_states) + input_tensor)


class BlipTextAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self = BlipTextSelfAttention(config)
        self.output = BlipTextSelfOutput(config)

    def forward(self, hidden_states, attention_mask=None, past_key_value=None):
        context, present = self.self(hidden_states, attention_mask, past_key_value)
        return self.output(context, hidden_states), present


class BlipTextIntermediate(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)

    def forward(self, hidden_states):
        return F.gelu(self.dense(hidden_states))


class BlipTextOutput(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.intermediate_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states, input_tensor):
        return self.LayerNorm(self.dense(hidden_states) + input_tensor)


class BlipTextLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention = BlipTextAttention(config)
        self.intermediate = BlipTextIntermediate(config)
        self.output = BlipTextOutput(config)

    def forward(self, hidden_states, attention_mask=None, past_key_value=None):
        attention_output, present = self.attention(hidden_states, attention_mask, past_key_value)
        layer_output = self.output(self.intermediate(attention_output), attention_output)
        return layer_output, present


class BlipTextEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layer = nn.ModuleList([BlipTextLayer(config) for _ in range(config.num_hidden_layers)])

    def forward(self, hidden_states, attention_mask, past_key_values=None, use_cache=False):
        next_decoder_cache = () if use_cache else None
        for i, layer_module in enumerate(self.layer):
            past = past_key_values[i] if past_key_values is not None else None
            hidden_states, present = layer_module(hidden_states, attention_mask, past)
            if use_cache:
                next_decoder_cache += (present,)
        return hidden_states, next_decoder_cache


class BlipTextModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embeddings = BlipTextEmbeddings(config)
        self.encoder = BlipTextEncoder(config)

    def get_extended_attention_mask(self, attention_mask, input_shape, dtype):
        batch_size, seq_length = input_shape
        seq_ids = torch.arange(seq_length, device=attention_mask.device)
        causal_mask = seq_ids[None, None, :].repeat(batch_size, seq_length, 1) <= seq_ids[None, :, None]
        causal_mask = causal_mask.to(attention_mask.dtype)
        if causal_mask.shape[1] < attention_mask.shape[1]:
            prefix_seq_len = attention_mask.shape[1] - causal_mask.shape[1]
            causal_mask = torch.cat(
                [
                    torch.ones((batch_size, seq_length, prefix_seq_len), device=causal_mask.device,
                               dtype=causal_mask.dtype),
                    causal_mask,
                ],
                dim=-1,
            )
        extended_attention_mask = causal_mask[:, None, :, :] * attention_mask[:, None, None, :]
        extended_attention_mask = extended_attention_mask.to(dtype=dtype)
        return (1.0 - extended_attention_mask) * torch.finfo(dtype).min

    def forward(self, input_ids, attention_mask=None, past_key_values=None, use_cache=False):
        batch_size, seq_length = input_ids.shape
        past_key_values_length = past_key_values[0][0].shape[2] if past_key_values is not None else 0
        if attention_mask is None:
            attention_mask = torch.ones(batch_size, seq_length + past_key_values_length, device=input_ids.device)
        embedding_output = self.embeddings(input_ids, past_key_values_length=past_key_values_length)
        extended = self.get_extended_attention_mask(attention_mask, (batch_size, seq_length), embedding_output.dtype)
        return self.encoder(embedding_output, extended, past_key_values=past_key_values, use_cache=use_cache)


class BlipTextPredictionHeadTransform(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states):
        return self.LayerNorm(F.gelu(self.dense(hidden_states)))


class BlipTextLMPredictionHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.transform = BlipTextPredictionHeadTransform(config)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size)

    def forward(self, hidden_states):
        return self.decoder(self.transform(hidden_states))


class BlipTextOnlyMLMHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.predictions = BlipTextLMPredictionHead(config)

    def forward(self, sequence_output):
        return self.predictions(sequence_output)


class BlipTextLMHeadModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.bert = BlipTextModel(config)
        self.cls = BlipTextOnlyMLMHead(config)

    def forward(self, input_ids, attention_mask=None, past_key_values=None, use_cache=False):
        sequence_output, cache = self.bert(
            input_ids, attention_mask=attention_mask, past_key_values=past_key_values, use_cache=use_cache
        )
        return SimpleNamespace(logits=self.cls(sequence_output), past_key_values=cache)


def make_model():
    torch.manual_seed(1902)
    config = SimpleNamespace(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, max_position_embeddings=64, layer_norm_eps=1e-12, pad_token_id=0,
    )
    model = BlipTextLMHeadModel(config)
    g = torch.Generator().manual_seed(19021)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model.eval()

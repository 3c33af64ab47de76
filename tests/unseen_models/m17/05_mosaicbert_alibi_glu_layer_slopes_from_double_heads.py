"""MosaicBERT (mosaicml/examples, examples/benchmarks/bert/src/bert_layers.py), padded path.

BertForMaskedLM: bert (BertModel: embeddings with word + token_type embeddings and LayerNorm, no
position embeddings; encoder with layer.N = BertLayer: attention (BertUnpadAttention: self =
BertUnpadSelfAttention with one fused Wqkv (bias) viewed (b, s, 3, h, d), output = BertSelfOutput
dense + LayerNorm, post-norm) and mlp (BertGatedLinearUnitMLP: gated_layers, gelu gate, wo, layernorm)),
cls.predictions (transform + decoder).  The encoder builds ALiBi once (rebuild_alibi_tensor):
symmetric -slope * |i - j| with _get_alibi_head_slopes (4 heads: 2^-2, 2^-4, 2^-6, 2^-8), added with the
padding bias after q.k / sqrt(d).  The self-attention has no output projection of its own.
Unpadding (index_first_axis / pad_input) is skipped: every sequence is full length here.
Slip: layer 1 is a `BertUnpadSelfAttentionOwnAlibi` (a per-layer ALiBi experiment) that rebuilds its
slopes with the non-power-of-two branch formula `_get_alibi_head_slopes(2 * n_heads)[0::2]`, giving
2^-1, 2^-3, 2^-5, 2^-7 instead of the standard sequence.  Other layers use the encoder's alibi.
No cache.  Returns the MLM logits tensor.
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
        "bert.encoder.layer.0.attention.self",
        "bert.encoder.layer.1.attention.self",
        "bert.encoder.layer.2.attention.self",
    ],
    "kind": "multihead",
    "cache": None,
    "layer": "bert.encoder.layer.1.attention.self",
    "stage": "biased_scores",
    "mistake": "bias_slopes",
    "style": "MosaicBERT bert_layers.py (padded path): fused Wqkv viewed (b, s, 3, h, d), encoder-level symmetric ALiBi "
    "from _get_alibi_head_slopes, no position embeddings, BertSelfOutput post-norm, GLU MLP; layer 1 rebuilds "
    "slopes as _get_alibi_head_slopes(2h)[0::2] (2^-1, 2^-3, ...)",
}


def _get_alibi_head_slopes(n_heads):
    def get_slopes_power_of_2(n_heads):
        start = 2 ** (-(2 ** -(math.log2(n_heads) - 3)))
        ratio = start
        return [start * ratio**i for i in range(n_heads)]

    if math.log2(n_heads).is_integer():
        return get_slopes_power_of_2(n_heads)
    closest_power_of_2 = 2 ** math.floor(math.log2(n_heads))
    slopes_a = get_slopes_power_of_2(closest_power_of_2)
    slopes_b = _get_alibi_head_slopes(2 * closest_power_of_2)
    slopes_b = slopes_b[0::2][: n_heads - closest_power_of_2]
    return slopes_a + slopes_b


def build_alibi(size, slopes, dtype):
    context_position = torch.arange(size, dtype=torch.float64)[:, None]
    memory_position = torch.arange(size, dtype=torch.float64)[None, :]
    relative_position = torch.abs(memory_position - context_position)
    relative_position = relative_position.unsqueeze(0).expand(len(slopes), -1, -1)
    slopes_t = torch.tensor(slopes, dtype=torch.float64)
    alibi = slopes_t.unsqueeze(1).unsqueeze(1) * -relative_position
    return alibi.unsqueeze(0).to(dtype)  # (1, h, s, s)


class BertEmbeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids, token_type_ids=None):
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        return self.LayerNorm(self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids))


class BertUnpadSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.Wqkv = nn.Linear(config.hidden_size, 3 * self.all_head_size)

    def layer_bias(self, bias, alibi):
        return bias + alibi

    def forward(self, hidden_states, bias, alibi):
        b, s, _ = hidden_states.shape
        qkv = self.Wqkv(hidden_states)
        qkv = qkv.view(b, s, 3, self.num_attention_heads, self.attention_head_size)
        q = qkv[:, :, 0, :, :].permute(0, 2, 1, 3)  # b h s d
        k = qkv[:, :, 1, :, :].permute(0, 2, 3, 1)  # b h d s
        v = qkv[:, :, 2, :, :].permute(0, 2, 1, 3)  # b h s d
        attention_scores = torch.matmul(q, k) / math.sqrt(self.attention_head_size)
        attention_scores = attention_scores + self.layer_bias(bias, alibi)
        attention_probs = F.softmax(attention_scores, dim=-1)
        attention = torch.matmul(attention_probs, v).permute(0, 2, 1, 3)
        return attention.reshape(b, s, self.all_head_size)


class BertUnpadSelfAttentionOwnAlibi(BertUnpadSelfAttention):
    def layer_bias(self, bias, alibi):
        n = self.num_attention_heads
        slopes = _get_alibi_head_slopes(2 * n)[0::2][:n]
        return bias + build_alibi(alibi.shape[-1], slopes, alibi.dtype)


class BertSelfOutput(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states, input_tensor):
        return self.LayerNorm(self.dense(hidden_states) + input_tensor)


class BertUnpadAttention(nn.Module):
    def __init__(self, config, own_alibi=False):
        super().__init__()
        cls = BertUnpadSelfAttentionOwnAlibi if own_alibi else BertUnpadSelfAttention
        self.self = cls(config)
        self.output = BertSelfOutput(config)

    def forward(self, input_tensor, bias, alibi):
        return self.output(self.self(input_tensor, bias, alibi), input_tensor)


class BertGatedLinearUnitMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.gated_layers = nn.Linear(config.hidden_size, config.intermediate_size * 2, bias=False)
        self.wo = nn.Linear(config.intermediate_size, config.hidden_size)
        self.layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states):
        residual_connection = hidden_states
        hidden_states = self.gated_layers(hidden_states)
        gated = hidden_states[..., : self.config.intermediate_size]
        non_gated = hidden_states[..., self.config.intermediate_size :]
        hidden_states = F.gelu(gated, approximate="none") * non_gated
        hidden_states = self.wo(hidden_states)
        return self.layernorm(hidden_states + residual_connection)


class BertLayer(nn.Module):
    def __init__(self, config, own_alibi=False):
        super().__init__()
        self.attention = BertUnpadAttention(config, own_alibi)
        self.mlp = BertGatedLinearUnitMLP(config)

    def forward(self, hidden_states, bias, alibi):
        return self.mlp(self.attention(hidden_states, bias, alibi))


class BertEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.layer = nn.ModuleList(
            [BertLayer(config, own_alibi=(i in config.own_alibi_layers)) for i in range(config.num_hidden_layers)]
        )

    def forward(self, hidden_states, attention_mask):
        dtype = hidden_states.dtype
        seqlen = hidden_states.shape[1]
        alibi = build_alibi(seqlen, _get_alibi_head_slopes(self.num_attention_heads), dtype)
        extended = attention_mask[:, None, None, :].to(dtype)
        bias = (1.0 - extended) * -10000.0
        for layer_module in self.layer:
            hidden_states = layer_module(hidden_states, bias, alibi)
        return hidden_states


class BertModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)

    def forward(self, input_ids, attention_mask=None):
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        return self.encoder(self.embeddings(input_ids), attention_mask)


class BertPredictionHeadTransform(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x):
        return self.LayerNorm(F.gelu(self.dense(x)))


class BertLMPredictionHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.transform = BertPredictionHeadTransform(config)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size)

    def forward(self, x):
        return self.decoder(self.transform(x))


class BertOnlyMLMHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.predictions = BertLMPredictionHead(config)

    def forward(self, x):
        return self.predictions(x)


class BertForMaskedLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.bert = BertModel(config)
        self.cls = BertOnlyMLMHead(config)

    def forward(self, input_ids, attention_mask=None):
        return self.cls(self.bert(input_ids, attention_mask=attention_mask))


def make_model():
    torch.manual_seed(1705)
    config = SimpleNamespace(
        vocab_size=96,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=128,
        type_vocab_size=2,
        layer_norm_eps=1e-12,
        pad_token_id=0,
        own_alibi_layers=(1,),
    )
    model = BertForMaskedLM(config)
    g = torch.Generator().manual_seed(17051)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model.eval()

"""Jina-BERT v2 (jinaai/jina-bert-implementation modeling_bert.py) as a masked LM: a BERT with symmetric ALiBi.

JinaBertForMaskedLM: bert (JinaBertModel: embeddings = word + token_type + LayerNorm, no position
embeddings; encoder with `layer.N` and a model-level `alibi` buffer from rebuild_alibi_tensor:
-slope_h * |j - i|, standard geometric slopes 2^-2, 2^-4, 2^-6, 2^-8 for 4 heads), then
cls.predictions (transform dense/GELU/LayerNorm, decoder).  JinaBertLayer: attention.self
(JinaBertSelfAttention: query/key/value with bias, transpose_for_scores, q.k^T / sqrt(d), + extended
padding mask, + the ALiBi bias, softmax; no own output projection) -> attention.output (dense +
residual + LayerNorm, post-norm) -> mlp (JinaBertGLUMLP: gated_layers, GELU gate, wo, residual,
layernorm).  Bidirectional (no causal mask).
Slip: the config lists one attention implementation per layer; layer 1 is "slopes"
(JinaBertSlopesSelfAttention, written for a kernel that takes `alibi_slopes` and negates them itself):
it rebuilds the bias as +slope_h * |j - i| from the raw positive slopes, so distant tokens are favoured.
No cache.  Returns an object with `.logits`.
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
    "mistake": "bias_sign",
    "style": "Jina-BERT v2: BERT tree without position embeddings, symmetric ALiBi (-slope*|j-i|) buffer on the encoder, "
    "post-norm, GLU MLP; layer 1's 'slopes' attention adds +slope*|j-i| (raw positive slopes)",
}


def _get_alibi_head_slopes(n_heads):
    def get_slopes_power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        ratio = start
        return [start * ratio**i for i in range(n)]

    if math.log2(n_heads).is_integer():
        return get_slopes_power_of_2(n_heads)
    closest_power_of_2 = 2 ** math.floor(math.log2(n_heads))
    return (
        get_slopes_power_of_2(closest_power_of_2)
        + _get_alibi_head_slopes(2 * closest_power_of_2)[0::2][: n_heads - closest_power_of_2]
    )


class JinaBertEmbeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids, token_type_ids=None):
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        embeddings = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(embeddings)


class JinaBertSelfAttention(nn.Module):
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

    def _position_bias(self, bias, seq_len):
        return bias

    def forward(self, hidden_states, attention_mask=None, bias=None):
        query_layer = self.transpose_for_scores(self.query(hidden_states))
        key_layer = self.transpose_for_scores(self.key(hidden_states))
        value_layer = self.transpose_for_scores(self.value(hidden_states))
        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        if attention_mask is not None:
            attention_scores = attention_scores + attention_mask
        bias = self._position_bias(bias, hidden_states.shape[1])
        if bias is not None:
            attention_scores = attention_scores + bias
        attention_probs = F.softmax(attention_scores, dim=-1)
        context_layer = torch.matmul(attention_probs, value_layer)
        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        new_context_layer_shape = context_layer.size()[:-2] + (self.all_head_size,)
        return context_layer.view(new_context_layer_shape)


class JinaBertSlopesSelfAttention(JinaBertSelfAttention):
    """Variant for a kernel that takes per-head `alibi_slopes` instead of a bias tensor."""

    def __init__(self, config):
        super().__init__(config)
        self.alibi_slopes = _get_alibi_head_slopes(config.num_attention_heads)

    def _position_bias(self, bias, seq_len):
        device = bias.device if bias is not None else None
        pos = torch.arange(seq_len, device=device)
        relative_position = torch.abs(pos[None, :] - pos[:, None]).to(torch.float64)
        slopes = torch.tensor(self.alibi_slopes, dtype=torch.float64, device=device)
        return (slopes[:, None, None] * relative_position)[None].to(bias.dtype)


ATTENTION_CLASSES = {"torch": JinaBertSelfAttention, "slopes": JinaBertSlopesSelfAttention}


class JinaBertSelfOutput(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states, input_tensor):
        return self.LayerNorm(self.dense(hidden_states) + input_tensor)


class JinaBertAttention(nn.Module):
    def __init__(self, config, attn_impl):
        super().__init__()
        self.self = ATTENTION_CLASSES[attn_impl](config)
        self.output = JinaBertSelfOutput(config)

    def forward(self, hidden_states, attention_mask=None, bias=None):
        self_outputs = self.self(hidden_states, attention_mask, bias=bias)
        return self.output(self_outputs, hidden_states)


class JinaBertGLUMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gated_layers = nn.Linear(config.hidden_size, config.intermediate_size * 2, bias=False)
        self.act = nn.GELU()
        self.wo = nn.Linear(config.intermediate_size, config.hidden_size)
        self.layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states):
        residual_connection = hidden_states
        hidden_states = self.gated_layers(hidden_states)
        gated = hidden_states[:, :, : self.intermediate_size]
        non_gated = hidden_states[:, :, self.intermediate_size :]
        hidden_states = self.act(gated) * non_gated
        hidden_states = self.wo(hidden_states)
        return self.layernorm(hidden_states + residual_connection)


class JinaBertLayer(nn.Module):
    def __init__(self, config, attn_impl):
        super().__init__()
        self.attention = JinaBertAttention(config, attn_impl)
        self.mlp = JinaBertGLUMLP(config)

    def forward(self, hidden_states, attention_mask=None, bias=None):
        attention_output = self.attention(hidden_states, attention_mask, bias=bias)
        return self.mlp(attention_output)


class JinaBertEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.layer = nn.ModuleList(
            [JinaBertLayer(config, config.attn_implementation[i]) for i in range(config.num_hidden_layers)]
        )
        self._current_alibi_size = config.max_position_embeddings

    def rebuild_alibi_tensor(self, size, device=None):
        n_heads = self.num_attention_heads
        context_position = torch.arange(size, device=device)[:, None]
        memory_position = torch.arange(size, device=device)[None, :]
        relative_position = torch.abs(memory_position - context_position)[None, :, :].expand(n_heads, -1, -1)
        slopes = torch.tensor(_get_alibi_head_slopes(n_heads), dtype=torch.float64, device=device) * -1
        alibi = slopes.unsqueeze(1).unsqueeze(1) * relative_position.to(torch.float64)
        return alibi.unsqueeze(0)

    def forward(self, hidden_states, attention_mask=None):
        seqlen = hidden_states.shape[1]
        alibi_bias = self.rebuild_alibi_tensor(self._current_alibi_size, hidden_states.device)
        alibi_bias = alibi_bias[:, :, :seqlen, :seqlen].to(hidden_states.dtype)
        for layer_module in self.layer:
            hidden_states = layer_module(hidden_states, attention_mask, bias=alibi_bias)
        return hidden_states


class JinaBertModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embeddings = JinaBertEmbeddings(config)
        self.encoder = JinaBertEncoder(config)

    def forward(self, input_ids, attention_mask=None, token_type_ids=None):
        embedding_output = self.embeddings(input_ids, token_type_ids)
        extended = None
        if attention_mask is not None:
            dtype = embedding_output.dtype
            extended = (1.0 - attention_mask[:, None, None, :].to(dtype)) * torch.finfo(dtype).min
        return self.encoder(embedding_output, extended)


class JinaBertPredictionHeadTransform(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.transform_act_fn = nn.GELU()
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states):
        return self.LayerNorm(self.transform_act_fn(self.dense(hidden_states)))


class JinaBertLMPredictionHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.transform = JinaBertPredictionHeadTransform(config)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size)

    def forward(self, hidden_states):
        return self.decoder(self.transform(hidden_states))


class JinaBertOnlyMLMHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.predictions = JinaBertLMPredictionHead(config)

    def forward(self, sequence_output):
        return self.predictions(sequence_output)


class JinaBertForMaskedLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.bert = JinaBertModel(config)
        self.cls = JinaBertOnlyMLMHead(config)

    def forward(self, input_ids, attention_mask=None, token_type_ids=None):
        sequence_output = self.bert(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        return SimpleNamespace(logits=self.cls(sequence_output))


def make_model():
    torch.manual_seed(1605)
    config = SimpleNamespace(
        vocab_size=96,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=128,
        type_vocab_size=2,
        max_position_embeddings=64,
        layer_norm_eps=1e-12,
        pad_token_id=0,
        attn_implementation=["torch", "slopes", "torch"],
    )
    model = JinaBertForMaskedLM(config)
    g = torch.Generator().manual_seed(16051)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model.eval()

"""ALBERT masked-LM (modeling_albert.py style): one transformer layer shared across depth.

Factorised embeddings (32) mapped to the hidden size (64) by embedding_hidden_mapping_in; one layer
group holding one AlbertLayer, applied num_hidden_layers = 3 times (group index
int(i / (num_hidden_layers / num_hidden_groups)) is always 0).  So there is a single attention
module, run three times per forward on three different inputs.  Post-norm; additive extended
attention mask; MLM head predictions.dense/LayerNorm/decoder.  No cache (encoder).

Note: in transformers' AlbertAttention the residual add and LayerNorm sit inside the attention
module; here they sit in AlbertLayer (attention_layer_norm) so that the attention module returns
the projected context.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": ["albert.encoder.albert_layer_groups.0.albert_layers.0.attention"],
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
    "style": "ALBERT: factorised embeddings 32->64, one AlbertLayer shared by all 3 depths (one attention module called 3 "
    "times per forward), query/key/value/dense, additive extended mask, post-norm, MLM predictions head",
}


class AlbertConfig:
    vocab_size = 120
    embedding_size = 32
    hidden_size = 64
    num_hidden_layers = 3
    num_hidden_groups = 1
    inner_group_num = 1
    num_attention_heads = 4
    intermediate_size = 128
    max_position_embeddings = 64
    type_vocab_size = 2
    layer_norm_eps = 1e-12


class AlbertEmbeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.embedding_size)
        self.position_embeddings = nn.Embedding(
            config.max_position_embeddings, config.embedding_size
        )
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.embedding_size)
        self.LayerNorm = nn.LayerNorm(config.embedding_size, eps=config.layer_norm_eps)
        self.register_buffer(
            "position_ids",
            torch.arange(config.max_position_embeddings).expand((1, -1)),
            persistent=False,
        )

    def forward(self, input_ids, token_type_ids=None):
        seq_length = input_ids.shape[1]
        position_ids = self.position_ids[:, :seq_length]
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        emb = (
            self.word_embeddings(input_ids)
            + self.token_type_embeddings(token_type_ids)
            + self.position_embeddings(position_ids)
        )
        return self.LayerNorm(emb)


class AlbertAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.query = nn.Linear(config.hidden_size, self.all_head_size)
        self.key = nn.Linear(config.hidden_size, self.all_head_size)
        self.value = nn.Linear(config.hidden_size, self.all_head_size)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

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
        attention_probs = nn.functional.softmax(attention_scores, dim=-1)
        context_layer = torch.matmul(attention_probs, value_layer)
        context_layer = context_layer.transpose(2, 1).flatten(2)
        return self.dense(context_layer)


class AlbertLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention = AlbertAttention(config)
        self.attention_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.ffn = nn.Linear(config.hidden_size, config.intermediate_size)
        self.ffn_output = nn.Linear(config.intermediate_size, config.hidden_size)
        self.full_layer_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.activation = nn.GELU(approximate="tanh")

    def forward(self, hidden_states, attention_mask=None):
        attention_output = self.attention_layer_norm(
            hidden_states + self.attention(hidden_states, attention_mask)
        )
        ffn_output = self.ffn_output(self.activation(self.ffn(attention_output)))
        return self.full_layer_layer_norm(ffn_output + attention_output)


class AlbertLayerGroup(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.albert_layers = nn.ModuleList(
            [AlbertLayer(config) for _ in range(config.inner_group_num)]
        )

    def forward(self, hidden_states, attention_mask=None):
        for albert_layer in self.albert_layers:
            hidden_states = albert_layer(hidden_states, attention_mask)
        return hidden_states


class AlbertTransformer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embedding_hidden_mapping_in = nn.Linear(config.embedding_size, config.hidden_size)
        self.albert_layer_groups = nn.ModuleList(
            [AlbertLayerGroup(config) for _ in range(config.num_hidden_groups)]
        )

    def forward(self, hidden_states, attention_mask=None):
        hidden_states = self.embedding_hidden_mapping_in(hidden_states)
        layers_per_group = int(self.config.num_hidden_layers / self.config.num_hidden_groups)
        for i in range(self.config.num_hidden_layers):
            group_idx = int(i / (self.config.num_hidden_layers / self.config.num_hidden_groups))
            hidden_states = self.albert_layer_groups[group_idx](hidden_states, attention_mask)
        return hidden_states


class AlbertModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embeddings = AlbertEmbeddings(config)
        self.encoder = AlbertTransformer(config)

    def forward(self, input_ids, attention_mask=None):
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        ext = attention_mask[:, None, None, :].to(self.embeddings.word_embeddings.weight.dtype)
        ext = (1.0 - ext) * torch.finfo(ext.dtype).min
        return self.encoder(self.embeddings(input_ids), ext)


class AlbertMLMHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.embedding_size)
        self.LayerNorm = nn.LayerNorm(config.embedding_size, eps=config.layer_norm_eps)
        self.decoder = nn.Linear(config.embedding_size, config.vocab_size)
        self.activation = nn.GELU(approximate="tanh")

    def forward(self, hidden_states):
        return self.decoder(self.LayerNorm(self.activation(self.dense(hidden_states))))


@dataclass
class MaskedLMOutput:
    logits: torch.Tensor


class AlbertForMaskedLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.albert = AlbertModel(config)
        self.predictions = AlbertMLMHead(config)

    def forward(self, input_ids, attention_mask=None):
        return MaskedLMOutput(logits=self.predictions(self.albert(input_ids, attention_mask)))


def make_model():
    torch.manual_seed(703)
    model = AlbertForMaskedLM(AlbertConfig())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.5 if "embeddings" in name else 0.08)
            elif "LayerNorm" in name or "layer_norm" in name:
                if name.endswith("weight"):
                    p.copy_(1.0 + 0.3 * torch.randn_like(p))
                else:
                    p.copy_(0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.02)
    return model.eval()

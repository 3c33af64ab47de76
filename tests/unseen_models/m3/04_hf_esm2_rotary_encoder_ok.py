"""A tiny ESM-2 protein encoder in the style of modeling_esm.py (returns hidden states).

EsmModel: embeddings (word_embeddings, token_dropout rescaling off) -> encoder.layer ModuleList ->
emb_layer_norm_after.  Pre-norm inside EsmAttention: LayerNorm -> EsmSelfAttention -> EsmSelfOutput
(dense + residual).  EsmSelfAttention has query/key/value with bias, scales the query by
head_dim ** -0.5 BEFORE the rotary (position_embedding_type="rotary", halves layout, base 10000),
adds an additive extended attention mask, and has no output projection of its own (the dense lives
in attention.output, like BERT).  Bidirectional; 4 heads of 12 (hidden 48).

Call model(input_ids) or model(input_ids, attention_mask).  No cache.  Correct.
"""

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

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
        "head_dim": 12,
        "causal": False,
        "rope": {"pairing": "half", "fraction": 1.0, "base": 10000.0},
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "transformers modeling_esm.py: pre-norm EsmAttention, rotary applied after the query is "
    "scaled, self-attention without own out-proj, extended additive mask",
}


@dataclass
class EsmConfig:
    vocab_size: int = 64
    hidden_size: int = 48
    num_hidden_layers: int = 3
    num_attention_heads: int = 4
    intermediate_size: int = 96
    layer_norm_eps: float = 1e-5


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, dim):
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        self.register_buffer("inv_freq", inv_freq)

    def forward(self, q, k):
        seq_len = k.shape[-2]
        t = torch.arange(seq_len, device=k.device).type_as(self.inv_freq)
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1).to(k.dtype)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class EsmSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.query = nn.Linear(config.hidden_size, self.all_head_size)
        self.key = nn.Linear(config.hidden_size, self.all_head_size)
        self.value = nn.Linear(config.hidden_size, self.all_head_size)
        self.rotary_embeddings = RotaryEmbedding(dim=self.attention_head_size)

    def transpose_for_scores(self, x):
        new_x_shape = x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)
        return x.view(new_x_shape).permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask=None):
        query_layer = self.transpose_for_scores(self.query(hidden_states))
        key_layer = self.transpose_for_scores(self.key(hidden_states))
        value_layer = self.transpose_for_scores(self.value(hidden_states))
        query_layer = query_layer * self.attention_head_size**-0.5
        query_layer, key_layer = self.rotary_embeddings(query_layer, key_layer)
        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
        if attention_mask is not None:
            attention_scores = attention_scores + attention_mask
        attention_probs = F.softmax(attention_scores, dim=-1)
        context_layer = torch.matmul(attention_probs, value_layer)
        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        return context_layer.view(context_layer.size()[:-2] + (self.all_head_size,))


class EsmSelfOutput(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden_states, input_tensor):
        return self.dense(hidden_states) + input_tensor


class EsmAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self = EsmSelfAttention(config)
        self.output = EsmSelfOutput(config)

    def forward(self, hidden_states, attention_mask=None):
        hidden_states_ln = self.LayerNorm(hidden_states)
        self_outputs = self.self(hidden_states_ln, attention_mask)
        return self.output(self_outputs, hidden_states)


class EsmLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention = EsmAttention(config)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.intermediate = nn.Linear(config.hidden_size, config.intermediate_size)
        self.output_dense = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, hidden_states, attention_mask=None):
        attention_output = self.attention(hidden_states, attention_mask)
        h = self.output_dense(F.gelu(self.intermediate(self.LayerNorm(attention_output))))
        return h + attention_output


class EsmEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layer = nn.ModuleList([EsmLayer(config) for _ in range(config.num_hidden_layers)])
        self.emb_layer_norm_after = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states, attention_mask=None):
        for layer_module in self.layer:
            hidden_states = layer_module(hidden_states, attention_mask)
        return self.emb_layer_norm_after(hidden_states)


class EsmEmbeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)

    def forward(self, input_ids, attention_mask=None):
        embeddings = self.word_embeddings(input_ids)
        if attention_mask is not None:
            embeddings = embeddings * attention_mask.unsqueeze(-1).to(embeddings.dtype)
        return embeddings


class EsmModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embeddings = EsmEmbeddings(config)
        self.encoder = EsmEncoder(config)

    def forward(self, input_ids, attention_mask=None):
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        embedding_output = self.embeddings(input_ids, attention_mask)
        dtype = embedding_output.dtype
        extended = attention_mask[:, None, None, :].to(dtype)
        extended = (1.0 - extended) * torch.finfo(dtype).min
        return self.encoder(embedding_output, extended)


def make_model():
    torch.manual_seed(3)
    model = EsmModel(EsmConfig())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.25 * torch.randn_like(m.weight))
                m.bias.copy_(0.05 * torch.randn_like(m.bias))
    return model.eval()

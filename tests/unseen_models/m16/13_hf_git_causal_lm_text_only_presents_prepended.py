"""GIT (Generative Image-to-text Transformer, transformers' modeling_git.py) run text-only as a causal LM.

GitForCausalLM: git (GitModel: embeddings = GitEmbeddings (word_embeddings + absolute
position_embeddings from the position_ids buffer offset by past_key_values_length, LayerNorm),
encoder (GitEncoder: layer.N)), output (Linear to the vocabulary).  No image is given, so the image
encoder and visual projection are not built and pixel_values_present is False (cutoff 0).
GitLayer is BERT-shaped and post-norm: attention.self (GitSelfAttention: query/key/value with bias,
transpose_for_scores, past keys/values concatenated on dim 2, q.k^T / sqrt(d), + mask, softmax, context;
no own output projection) -> attention.output (dense + residual + LayerNorm) -> intermediate
(dense, GELU) -> output (dense + residual + LayerNorm).  The causal mask is the last seq rows of a
(past + seq) future mask of -inf above the diagonal.  MHA 4 x 16.
Cache: hf tuples: `out = model(ids, use_cache=True)`, then
`model(tok, past_key_values=out.past_key_values, use_cache=True)`; each entry (key, value) in
(b, h, s, d) with the cutoff applied; logits in `out.logits`.
Slip: GitEncoder collects the presents as next_decoder_cache = (layer_outputs[-1],) + next_decoder_cache
(prepended instead of appended), so the returned tuple is in reverse layer order and, on the next call,
layer 0 attends over layer 2's cached keys and values (layer 1 happens to get its own).  Lengths, positions
and the mask are all right.
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
        "git.encoder.layer.0.attention.self",
        "git.encoder.layer.1.attention.self",
        "git.encoder.layer.2.attention.self",
    ],
    "kind": "causal-multihead",
    "cache": "hf",
    "decode": {
        "mistake": "cache_other",
        "step": 0,
        "layer": "git.encoder.layer.0.attention.self",
    },
    "style": "modeling_git.py GitForCausalLM text-only: BERT-shaped post-norm layers, GitSelfAttention with the "
    "pixel_values_present cutoff, absolute positions from the position_ids buffer, -inf future mask; the encoder "
    "prepends each layer's present, so the cache tuple comes back in reverse layer order",
}


class GitEmbeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.register_buffer(
            "position_ids", torch.arange(config.max_position_embeddings).expand((1, -1)), persistent=False
        )

    def forward(self, input_ids, past_key_values_length=0):
        seq_length = input_ids.size()[1]
        position_ids = self.position_ids[:, past_key_values_length : seq_length + past_key_values_length]
        embeddings = self.word_embeddings(input_ids) + self.position_embeddings(position_ids)
        return self.LayerNorm(embeddings)


class GitSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.image_patch_tokens = config.image_patch_tokens
        self.query = nn.Linear(config.hidden_size, self.all_head_size)
        self.key = nn.Linear(config.hidden_size, self.all_head_size)
        self.value = nn.Linear(config.hidden_size, self.all_head_size)

    def transpose_for_scores(self, x):
        new_x_shape = x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)
        return x.view(new_x_shape).permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask=None, past_key_value=None, pixel_values_present=False):
        mixed_query_layer = self.query(hidden_states)
        cutoff = self.image_patch_tokens if pixel_values_present else 0
        key_layer = self.transpose_for_scores(self.key(hidden_states))
        value_layer = self.transpose_for_scores(self.value(hidden_states))
        if past_key_value is not None:
            key_layer = torch.cat([key_layer[:, :, :cutoff, :], past_key_value[0], key_layer[:, :, cutoff:, :]], dim=2)
            value_layer = torch.cat(
                [value_layer[:, :, :cutoff, :], past_key_value[1], value_layer[:, :, cutoff:, :]], dim=2
            )
        query_layer = self.transpose_for_scores(mixed_query_layer)
        present = (key_layer[:, :, cutoff:, :], value_layer[:, :, cutoff:, :])
        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        if attention_mask is not None:
            attention_scores = attention_scores + attention_mask
        attention_probs = F.softmax(attention_scores, dim=-1)
        context_layer = torch.matmul(attention_probs, value_layer)
        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        context_layer = context_layer.view(context_layer.size()[:-2] + (self.all_head_size,))
        return context_layer, present


class GitSelfOutput(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states, input_tensor):
        return self.LayerNorm(self.dense(hidden_states) + input_tensor)


class GitAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self = GitSelfAttention(config)
        self.output = GitSelfOutput(config)

    def forward(self, hidden_states, attention_mask=None, past_key_value=None, pixel_values_present=False):
        attn_output, present = self.self(hidden_states, attention_mask, past_key_value, pixel_values_present)
        return self.output(attn_output, hidden_states), present


class GitIntermediate(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)

    def forward(self, hidden_states):
        return F.gelu(self.dense(hidden_states))


class GitOutput(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.intermediate_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states, input_tensor):
        return self.LayerNorm(self.dense(hidden_states) + input_tensor)


class GitLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention = GitAttention(config)
        self.intermediate = GitIntermediate(config)
        self.output = GitOutput(config)

    def forward(self, hidden_states, attention_mask=None, past_key_value=None, pixel_values_present=False):
        attention_output, present = self.attention(
            hidden_states, attention_mask, past_key_value=past_key_value, pixel_values_present=pixel_values_present
        )
        layer_output = self.output(self.intermediate(attention_output), attention_output)
        return (layer_output, present)


class GitEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layer = nn.ModuleList([GitLayer(config) for _ in range(config.num_hidden_layers)])

    def forward(self, hidden_states, attention_mask=None, past_key_values=None, use_cache=False, pixel_values_present=False):
        next_decoder_cache = () if use_cache else None
        for i, layer_module in enumerate(self.layer):
            past_key_value = past_key_values[i] if past_key_values is not None else None
            layer_outputs = layer_module(hidden_states, attention_mask, past_key_value, pixel_values_present)
            hidden_states = layer_outputs[0]
            if use_cache:
                next_decoder_cache = (layer_outputs[-1],) + next_decoder_cache
        return hidden_states, next_decoder_cache


class GitModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embeddings = GitEmbeddings(config)
        self.encoder = GitEncoder(config)

    def _generate_future_mask(self, size, dtype, device):
        mask = torch.triu(torch.ones(size, size, device=device, dtype=dtype), diagonal=1)
        return mask.masked_fill(mask == 1, float("-inf"))

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        seq_length = input_ids.shape[1]
        past_key_values_length = past_key_values[0][0].shape[2] if past_key_values is not None else 0
        embedding_output = self.embeddings(input_ids, past_key_values_length=past_key_values_length)
        full = self._generate_future_mask(past_key_values_length + seq_length, embedding_output.dtype, input_ids.device)
        attention_mask = full[-seq_length:, :][None, None]
        return self.encoder(
            embedding_output, attention_mask=attention_mask, past_key_values=past_key_values,
            use_cache=use_cache, pixel_values_present=False,
        )


class GitForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.git = GitModel(config)
        self.output = nn.Linear(config.hidden_size, config.vocab_size)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        sequence_output, cache = self.git(input_ids, past_key_values=past_key_values, use_cache=use_cache)
        return SimpleNamespace(logits=self.output(sequence_output), past_key_values=cache)


def make_model():
    torch.manual_seed(1613)
    config = SimpleNamespace(
        vocab_size=96,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
        layer_norm_eps=1e-12,
        pad_token_id=0,
        image_patch_tokens=5,
    )
    model = GitForCausalLM(config)
    g = torch.Generator().manual_seed(16131)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
        model.git.embeddings.position_embeddings.weight.normal_(0.0, 1.0, generator=g)
    return model.eval()

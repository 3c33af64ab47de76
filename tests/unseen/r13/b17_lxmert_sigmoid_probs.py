"""LXMERT (Hugging Face LxmertAttention) cross-modality attention, language to vision:
query/key/value Linears (key/value from ctx_dim = visual_feat_dim), transpose_for_scores,
matmul / sqrt(head_size), the extended (1 - mask) * -10000 mask (built by the wrapper when a visual
mask is given; None here), softmax,
context permuted back and viewed; no output projection in this module (LxmertAttentionOutput's dense
+ post-LayerNorm does it). Target takes (lang_feats, visual_feats).

This file: bug. torch.sigmoid in place of the softmax: weights are not normalised over keys."""

import math

import torch
from torch import nn


class LxmertConfig:
    hidden_size = 64
    num_attention_heads = 4
    attention_probs_dropout_prob = 0.1
    hidden_dropout_prob = 0.1
    visual_feat_dim = 48


class LxmertAttention(nn.Module):
    def __init__(self, config, ctx_dim=None):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = int(config.hidden_size / config.num_attention_heads)
        self.head_size = self.num_attention_heads * self.attention_head_size
        if ctx_dim is None:
            ctx_dim = config.hidden_size
        self.query = nn.Linear(config.hidden_size, self.head_size)
        self.key = nn.Linear(ctx_dim, self.head_size)
        self.value = nn.Linear(ctx_dim, self.head_size)
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)

    def transpose_for_scores(self, x):
        new_x_shape = x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)
        x = x.view(new_x_shape)
        return x.permute(0, 2, 1, 3)

    def forward(self, hidden_states, context, attention_mask=None, output_attentions=False):
        mixed_query_layer = self.query(hidden_states)
        mixed_key_layer = self.key(context)
        mixed_value_layer = self.value(context)

        query_layer = self.transpose_for_scores(mixed_query_layer)
        key_layer = self.transpose_for_scores(mixed_key_layer)
        value_layer = self.transpose_for_scores(mixed_value_layer)

        # Take the dot product between "query" and "key" to get the raw attention scores.
        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        # Apply the attention mask (precomputed for all layers in the model's forward)
        if attention_mask is not None:
            attention_scores = attention_scores + attention_mask

        # Normalize the attention scores to probabilities.
        attention_probs = torch.sigmoid(attention_scores)
        attention_probs = self.dropout(attention_probs)
        context_layer = torch.matmul(attention_probs, value_layer)

        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        new_context_layer_shape = context_layer.size()[:-2] + (self.head_size,)
        context_layer = context_layer.view(new_context_layer_shape)

        outputs = (context_layer, attention_probs) if output_attentions else (context_layer,)
        return outputs


class LxmertAttentionOutput(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=1e-12)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states, input_tensor):
        hidden_states = self.dense(hidden_states)
        hidden_states = self.dropout(hidden_states)
        return self.LayerNorm(hidden_states + input_tensor)


class LxmertCrossAttentionLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        ctx_dim = config.visual_feat_dim if config.visual_feat_dim != config.hidden_size else None
        self.att = LxmertAttention(config, ctx_dim=ctx_dim)
        self.output = LxmertAttentionOutput(config)

    def forward(self, input_tensor, ctx_tensor, ctx_att_mask=None, output_attentions=False):
        output = self.att(
            input_tensor, ctx_tensor, ctx_att_mask, output_attentions=output_attentions
        )
        attention_output = self.output(output[0], input_tensor)
        return (attention_output, output[1]) if output_attentions else (attention_output,)


class LxmertXLayerLangToVision(nn.Module):
    """The language-to-vision half of an LXMERT x-layer: the language stream (hidden) attends
    to the visual features (context); the model builds the extended visual mask itself."""

    def __init__(self, config):
        super().__init__()
        self.visual_attention = LxmertCrossAttentionLayer(config)

    def forward(self, lang_feats, visual_feats, visual_attention_mask=None):
        extended = None
        if visual_attention_mask is not None:
            extended = visual_attention_mask.unsqueeze(1).unsqueeze(2).to(dtype=lang_feats.dtype)
            extended = (1.0 - extended) * -10000.0
        return self.visual_attention(lang_feats, visual_feats, ctx_att_mask=extended)[0]


def make_lxmert_cross():
    torch.manual_seed(1324)
    model = LxmertXLayerLangToVision(LxmertConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {
    "target": "make_lxmert_cross",
    "kind": "cross",
    "ok": False,
    "layer": "visual_attention.att",
    "stage": "weights",
    "mistake": "not_softmax",
    "style": "LXMERT LxmertAttention: attention_probs = torch.sigmoid(attention_scores)",
}

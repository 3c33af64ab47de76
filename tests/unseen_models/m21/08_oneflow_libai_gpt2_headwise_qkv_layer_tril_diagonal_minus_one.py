"""Oneflow-Inc/libai GPT-2 (libai/models/gpt_model.py, libai/layers/attention.py) ported to torch.

GPTModel: embeddings (GPTEmbedding: token_embeddings, position_embeddings, dropout), casual_mask
(CasualMask: ones(s, s).tril() as a keep-mask), transformer (layers.N = TransformerLayer, layernorm_f)
and lm_head (LMLogits, tied to the token embedding).  TransformerLayer: input_layernorm ->
self_attention -> + residual, post_attention_layernorm -> mlp (dense_h_to_4h, gelu, dense_4h_to_h) ->
+ residual.  MultiheadAttention: one fused `query_key_value` Linear with bias whose output is laid out
per head, viewed (b, s, heads, 3*head_size) and permuted to (b, heads, s, 3*head_size) before
chunk(3, dim=-1); `dense` output Linear.  Scores: matmul(q, k^T) * norm_factor (1/sqrt(head_size)),
then the padding-type path: scores * mask - 10000 * (1 - mask); softmax; @ v.
Slip: layer 1 was built with attn_mask_type=causal, which takes the fused
scale-tril-softmax path; the port of oneflow's fused_scale_tril_softmax_mask_scale passes
`diagonal=-1`, so the tril keep-mask drops the diagonal and each token cannot see itself
(token 0 sees nothing and spreads evenly over all keys).  No cache.
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
        "transformer.layers.0.self_attention",
        "transformer.layers.1.self_attention",
        "transformer.layers.2.self_attention",
    ],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "transformer.layers.1.self_attention",
    "stage": "masked_scores",
    "mistake": "mask_diagonal",
    "style": "libai GPT-2: fused query_key_value laid out per head (b, s, h, 3d) then chunk, keep-mask from CasualMask "
    "applied as scores*mask - 10000*(1-mask), tied LMLogits; layer 1's fused tril path uses diagonal=-1",
}


def fused_scale_tril_softmax_mask_scale(scores, diagonal, tril_scale_value, tril_fill_value=-10000.0):
    s_q, s_k = scores.shape[-2], scores.shape[-1]
    keep = torch.ones(s_q, s_k, dtype=scores.dtype, device=scores.device).tril(diagonal=diagonal)
    scores = scores * tril_scale_value
    scores = scores * keep + tril_fill_value * (1 - keep)
    return F.softmax(scores, dim=-1)


class MultiheadAttention(nn.Module):
    def __init__(self, hidden_size, num_attention_heads, attn_mask_type="padding", layer_idx=0):
        super().__init__()
        self.hidden_size = hidden_size
        self.num_heads = num_attention_heads
        self.head_size = hidden_size // num_attention_heads
        self.attn_mask_type = attn_mask_type
        self.layer_idx = layer_idx
        self.norm_factor = 1.0 / math.sqrt(float(self.head_size))
        self.query_key_value = nn.Linear(hidden_size, hidden_size * 3)
        self.dense = nn.Linear(hidden_size, hidden_size)

    def forward(self, hidden_states, attention_mask=None):
        bsz, tgt_len = hidden_states.shape[:2]
        query_key_value = self.query_key_value(hidden_states)
        query_key_value = query_key_value.view(bsz, -1, self.num_heads, 3 * self.head_size)
        query_key_value = query_key_value.permute(0, 2, 1, 3)
        query, key, value = torch.chunk(query_key_value, chunks=3, dim=-1)
        if self.attn_mask_type == "causal":
            attention_scores = torch.matmul(query, key.transpose(-1, -2))
            attention_weights = fused_scale_tril_softmax_mask_scale(
                attention_scores, diagonal=-1, tril_scale_value=self.norm_factor
            )
        else:
            attention_scores = torch.matmul(query, key.transpose(-1, -2)) * self.norm_factor
            attention_weights = attention_scores * attention_mask
            attention_weights = attention_weights - 10000.0 * (1 - attention_mask)
            attention_weights = F.softmax(attention_weights, dim=-1)
        context = torch.matmul(attention_weights, value)
        context = context.transpose(1, 2).reshape(bsz, tgt_len, self.hidden_size)
        return self.dense(context)


class MLP(nn.Module):
    def __init__(self, hidden_size, ffn_hidden_size):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(hidden_size, ffn_hidden_size)
        self.dense_4h_to_h = nn.Linear(ffn_hidden_size, hidden_size)

    def forward(self, x):
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x), approximate="tanh"))


class TransformerLayer(nn.Module):
    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)
        self.self_attention = MultiheadAttention(
            cfg.hidden_size, cfg.num_attention_heads,
            attn_mask_type=cfg.attn_mask_types[layer_idx], layer_idx=layer_idx,
        )
        self.post_attention_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)
        self.mlp = MLP(cfg.hidden_size, cfg.ffn_hidden_size)

    def forward(self, hidden_states, attention_mask):
        hidden_states = hidden_states + self.self_attention(self.input_layernorm(hidden_states), attention_mask)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class Transformer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.layers = nn.ModuleList([TransformerLayer(cfg, i) for i in range(cfg.hidden_layers)])
        self.layernorm_f = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)

    def forward(self, hidden_states, attention_mask):
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask)
        return self.layernorm_f(hidden_states)


class GPTEmbedding(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.token_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_seq_length, cfg.hidden_size)
        self.dropout = nn.Dropout(cfg.embedding_dropout_prob)

    def forward(self, input_ids):
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        return self.dropout(self.token_embeddings(input_ids) + self.position_embeddings(position_ids))


class CasualMask(nn.Module):
    def forward(self, input_ids):
        s = input_ids.shape[1]
        return torch.ones(s, s, device=input_ids.device).tril()[None, None]


class LMLogits(nn.Module):
    def forward(self, x, word_embeddings):
        return torch.matmul(x, word_embeddings.t())


class GPTModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embeddings = GPTEmbedding(cfg)
        self.casual_mask = CasualMask()
        self.transformer = Transformer(cfg)
        self.lm_head = LMLogits()

    def forward(self, input_ids):
        input_embeds = self.embeddings(input_ids)
        attention_mask = self.casual_mask(input_ids).to(input_embeds.dtype)
        transformer_output = self.transformer(input_embeds, attention_mask)
        return self.lm_head(transformer_output, self.embeddings.token_embeddings.weight)


def make_model():
    torch.manual_seed(2108)
    cfg = SimpleNamespace(
        vocab_size=96, hidden_size=64, ffn_hidden_size=256, hidden_layers=3, num_attention_heads=4,
        max_seq_length=64, layernorm_epsilon=1e-5, embedding_dropout_prob=0.1,
        attn_mask_types=["padding", "causal", "padding"],
    )
    model = GPTModel(cfg)
    g = torch.Generator().manual_seed(21081)
    with torch.no_grad():
        model.embeddings.token_embeddings.weight.mul_(0.3)
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model.eval()

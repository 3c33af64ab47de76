"""OpenNMT-py decoder-only language model (onmt/decoders/transformer.py TransformerLMDecoder,
onmt/modules/multi_headed_attn.py) with `max_relative_positions = -2` (ALiBi), no position embeddings.

LanguageModel: decoder (TransformerLMDecoder: embeddings.make_embedding.emb_luts.0, transformer_layers.N,
layer_norm) and generator.  TransformerLMDecoderLayer: layer_norm_1 -> self_attn -> + residual ->
feed_forward (PositionwiseFeedForward with its own pre-norm `layer_norm`, w_1, w_2, + residual).
MultiHeadedAttention: linear_keys / linear_values / linear_query / final_linear with bias, query
divided by sqrt(dim_per_head) before the matmul, ALiBi bias added after the scale (slopes 2^-2, 2^-4,
2^-6, 2^-8 for 4 heads, bias = slope * (key - query) <= 0), a boolean future mask filled with -1e18,
softmax in float, context unshaped back to (b, s, heads * dim).
Slip: layer 2 builds its ALiBi matrix with a helper (`alibi_distance(..., symmetric=False)`) that takes
the distance as (query - key), so its bias is + slope * distance: distant keys are favoured.
No cache.  Returns a logits tensor (log-probabilities are not taken; the generator is a Linear).
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": [
        "decoder.transformer_layers.0.self_attn",
        "decoder.transformer_layers.1.self_attn",
        "decoder.transformer_layers.2.self_attn",
    ],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "decoder.transformer_layers.2.self_attn",
    "stage": "biased_scores",
    "mistake": "bias_sign",
    "style": "OpenNMT-py TransformerLMDecoder: emb_luts, transformer_layers, linear_keys/linear_values/linear_query/"
    "final_linear with bias, query / sqrt(d) first, ALiBi (max_relative_positions -2), -1e18 fill; layer 2's "
    "ALiBi distance taken as query - key (positive bias)",
}


def gen_alibi_slopes(n_heads):
    def pow2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(n_heads).is_integer():
        return pow2(n_heads)
    closest = 2 ** math.floor(math.log2(n_heads))
    return pow2(closest) + gen_alibi_slopes(2 * closest)[0::2][: n_heads - closest]


def alibi_distance(q_len, k_len, device, key_minus_query=True):
    q_pos = torch.arange(k_len - q_len, k_len, device=device)[:, None]
    k_pos = torch.arange(k_len, device=device)[None, :]
    return (k_pos - q_pos) if key_minus_query else (q_pos - k_pos)


class MultiHeadedAttention(nn.Module):
    def __init__(self, head_count, model_dim, alibi_key_minus_query=True):
        super().__init__()
        self.dim_per_head = model_dim // head_count
        self.model_dim = model_dim
        self.head_count = head_count
        self.linear_keys = nn.Linear(model_dim, model_dim)
        self.linear_values = nn.Linear(model_dim, model_dim)
        self.linear_query = nn.Linear(model_dim, model_dim)
        self.final_linear = nn.Linear(model_dim, model_dim)
        self.max_relative_positions = -2
        self.alibi_key_minus_query = alibi_key_minus_query
        self.register_buffer("alibi_slopes", torch.tensor(gen_alibi_slopes(head_count), dtype=torch.float64),
                             persistent=False)

    def shape(self, x):
        b = x.size(0)
        return x.view(b, -1, self.head_count, self.dim_per_head).transpose(1, 2)

    def unshape(self, x):
        b = x.size(0)
        return x.transpose(1, 2).contiguous().view(b, -1, self.head_count * self.dim_per_head)

    def forward(self, key, value, query, mask=None):
        key = self.shape(self.linear_keys(key))
        value = self.shape(self.linear_values(value))
        query = self.shape(self.linear_query(query))
        query = query / math.sqrt(self.dim_per_head)
        scores = torch.matmul(query, key.transpose(2, 3))
        q_len, k_len = scores.size(2), scores.size(3)
        if self.max_relative_positions == -2:
            dist = alibi_distance(q_len, k_len, scores.device, self.alibi_key_minus_query).to(scores.dtype)
            alibi = self.alibi_slopes.to(scores.dtype)[:, None, None] * dist[None]
            scores = scores + alibi.unsqueeze(0)
        scores = scores.float() if scores.dtype != torch.float64 else scores
        if mask is not None:
            scores = scores.masked_fill(mask, -1e18)
        attn = F.softmax(scores, dim=-1).to(query.dtype)
        context = self.unshape(torch.matmul(attn, value))
        return self.final_linear(context), attn


class PositionwiseFeedForward(nn.Module):
    def __init__(self, d_model, d_ff):
        super().__init__()
        self.w_1 = nn.Linear(d_model, d_ff)
        self.w_2 = nn.Linear(d_ff, d_model)
        self.layer_norm = nn.LayerNorm(d_model, eps=1e-6)

    def forward(self, x):
        return x + self.w_2(F.relu(self.w_1(self.layer_norm(x))))


class TransformerLMDecoderLayer(nn.Module):
    def __init__(self, d_model, heads, d_ff, alibi_key_minus_query=True):
        super().__init__()
        self.self_attn = MultiHeadedAttention(heads, d_model, alibi_key_minus_query)
        self.feed_forward = PositionwiseFeedForward(d_model, d_ff)
        self.layer_norm_1 = nn.LayerNorm(d_model, eps=1e-6)

    def forward(self, layer_in, future_mask):
        norm_layer_in = self.layer_norm_1(layer_in)
        attn_output, _ = self.self_attn(norm_layer_in, norm_layer_in, norm_layer_in, mask=future_mask)
        return self.feed_forward(attn_output + layer_in)


class Embeddings(nn.Module):
    def __init__(self, vocab_size, dim):
        super().__init__()
        self.make_embedding = nn.Sequential()
        self.make_embedding.add_module("emb_luts", nn.ModuleList([nn.Embedding(vocab_size, dim, padding_idx=1)]))

    def forward(self, src):
        return self.make_embedding.emb_luts[0](src)


class TransformerLMDecoder(nn.Module):
    def __init__(self, num_layers, d_model, heads, d_ff, vocab_size, flipped_layers=(2,)):
        super().__init__()
        self.embeddings = Embeddings(vocab_size, d_model)
        self.transformer_layers = nn.ModuleList(
            [TransformerLMDecoderLayer(d_model, heads, d_ff, alibi_key_minus_query=i not in flipped_layers)
             for i in range(num_layers)]
        )
        self.layer_norm = nn.LayerNorm(d_model, eps=1e-6)

    def forward(self, tgt):
        emb = self.embeddings(tgt)
        T = tgt.size(1)
        future_mask = torch.ones(T, T, device=tgt.device, dtype=torch.bool).triu_(1).view(1, 1, T, T)
        output = emb
        for layer in self.transformer_layers:
            output = layer(output, future_mask)
        return self.layer_norm(output)


class LanguageModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.decoder = TransformerLMDecoder(num_layers=3, d_model=64, heads=4, d_ff=128, vocab_size=128)
        self.generator = nn.Linear(64, 128)

    def forward(self, tgt):
        return self.generator(self.decoder(tgt))


def make_model():
    torch.manual_seed(0)
    model = LanguageModel()
    for m in model.modules():
        if isinstance(m, nn.LayerNorm):
            nn.init.uniform_(m.weight, 0.6, 1.4)
            nn.init.uniform_(m.bias, -0.1, 0.1)
    return model.eval()

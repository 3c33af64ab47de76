"""Tencent's UER-py / TencentPretrain GPT-2 (models/model.py Model, embeddings/word+pos, encoders/
transformer_encoder.py, layers/transformer.py, layers/multi_headed_attn.py, targets/lm_target.py).

Model: embedding (Embedding holding `word` and `pos` sub-embeddings plus `layer_norm`/`dropout` flags;
GPT-2 config: no embedding layer norm), encoder (TransformerEncoder: `transformer` ModuleList of
TransformerLayer, `layer_norm` at the end because layernorm_positioning = "pre", mask "causal"),
target (LmTarget: `output_layer`).  TransformerLayer (pre-LN): layer_norm_1 -> self_attn -> dropout
-> + residual, layer_norm_2 -> feed_forward (linear_1, gelu, linear_2) -> + residual.
MultiHeadedAttention: `linear_layers` = ModuleList of the query, key and value Linear (with bias),
`final_linear`; scores = q @ k^T / sqrt(per_head_size), + additive mask ((1 - tril) * -10000),
softmax, probs @ value, unshape.
Slip: layer 1 is built with `attention_layout="kq"` (a variant whose probs are kept keys-by-queries for
a memory-efficient backward); the forward still makes query-by-key probs but combines them as
probs^T @ value.  Every score, mask and softmax is right; only the context is wrong.
No cache.  Returns a logits tensor.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["encoder.transformer.0.self_attn", "encoder.transformer.1.self_attn", "encoder.transformer.2.self_attn"],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "encoder.transformer.1.self_attn",
    "stage": "context",
    "mistake": "context_wrong_product",
    "style": "UER-py/TencentPretrain: embedding.word/pos, encoder.transformer.N with linear_layers [q, k, v] and "
    "final_linear, additive -10000 causal mask, pre-LN, target.output_layer; layer 1 multiplies the transposed "
    "probabilities with the values",
}


class WordEmbedding(nn.Module):
    def __init__(self, args, vocab_size):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, args.emb_size)

    def forward(self, src, _):
        return self.embedding(src)


class PosEmbedding(nn.Module):
    def __init__(self, args, _):
        super().__init__()
        self.embedding = nn.Embedding(args.max_seq_length, args.emb_size)

    def forward(self, src, _):
        seq_length = src.size(1)
        pos = torch.arange(0, seq_length, device=src.device, dtype=torch.long).unsqueeze(0).repeat(src.size(0), 1)
        return self.embedding(pos)


class Embedding(nn.Module):
    def __init__(self, args, vocab_size):
        super().__init__()
        self.embedding_name_list = ["word", "pos"]
        self.word = WordEmbedding(args, vocab_size)
        self.pos = PosEmbedding(args, vocab_size)
        self.dropout = nn.Dropout(args.dropout)

    def forward(self, src, seg):
        emb = None
        for name in self.embedding_name_list:
            e = getattr(self, name)(src, seg)
            emb = e if emb is None else emb + e
        return self.dropout(emb)


class MultiHeadedAttention(nn.Module):
    def __init__(self, hidden_size, heads_num, attention_head_size, with_scale=True, attention_layout="qk"):
        super().__init__()
        self.heads_num = heads_num
        self.per_head_size = attention_head_size
        self.with_scale = with_scale
        self.inner_hidden_size = heads_num * attention_head_size
        self.attention_layout = attention_layout
        self.linear_layers = nn.ModuleList([nn.Linear(hidden_size, self.inner_hidden_size) for _ in range(3)])
        self.final_linear = nn.Linear(self.inner_hidden_size, hidden_size)

    def forward(self, key, value, query, mask):
        batch_size, seq_length, _ = query.size()
        heads_num, per_head_size = self.heads_num, self.per_head_size

        def shape(x):
            return x.contiguous().view(batch_size, -1, heads_num, per_head_size).transpose(1, 2)

        def unshape(x):
            return x.transpose(1, 2).contiguous().view(batch_size, -1, self.inner_hidden_size)

        query, key, value = [shape(l(x)) for l, x in zip(self.linear_layers, (query, key, value))]
        scores = torch.matmul(query, key.transpose(-2, -1))
        if self.with_scale:
            scores = scores / math.sqrt(float(per_head_size))
        scores = scores + mask.type_as(scores)
        probs = F.softmax(scores, dim=-1)
        if self.attention_layout == "kq":
            output = unshape(torch.matmul(probs.transpose(-2, -1), value))
        else:
            output = unshape(torch.matmul(probs, value))
        return self.final_linear(output), scores


class PositionwiseFeedForward(nn.Module):
    def __init__(self, hidden_size, feedforward_size):
        super().__init__()
        self.linear_1 = nn.Linear(hidden_size, feedforward_size)
        self.linear_2 = nn.Linear(feedforward_size, hidden_size)

    def forward(self, x):
        return self.linear_2(F.gelu(self.linear_1(x)))


class TransformerLayer(nn.Module):
    def __init__(self, args, attention_layout="qk"):
        super().__init__()
        self.self_attn = MultiHeadedAttention(args.hidden_size, args.heads_num, args.hidden_size // args.heads_num,
                                              attention_layout=attention_layout)
        self.dropout_1 = nn.Dropout(args.dropout)
        self.feed_forward = PositionwiseFeedForward(args.hidden_size, args.feedforward_size)
        self.dropout_2 = nn.Dropout(args.dropout)
        self.layer_norm_1 = nn.LayerNorm(args.hidden_size)
        self.layer_norm_2 = nn.LayerNorm(args.hidden_size)

    def forward(self, hidden, mask):
        inter = self.layer_norm_1(hidden)
        inter = self.dropout_1(self.self_attn(inter, inter, inter, mask)[0])
        hidden = hidden + inter
        return hidden + self.dropout_2(self.feed_forward(self.layer_norm_2(hidden)))


class TransformerEncoder(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.mask = args.mask
        self.layers_num = args.layers_num
        self.transformer = nn.ModuleList(
            [TransformerLayer(args, "kq" if i in args.kq_layers else "qk") for i in range(self.layers_num)]
        )
        self.layer_norm = nn.LayerNorm(args.hidden_size)

    def forward(self, emb, seg):
        batch_size, seq_length, _ = emb.size()
        mask = torch.ones(seq_length, seq_length, device=emb.device)
        mask = torch.tril(mask)
        mask = (1.0 - mask) * -10000
        mask = mask.repeat(batch_size, 1, 1, 1)
        hidden = emb
        for layer in self.transformer:
            hidden = layer(hidden, mask)
        return self.layer_norm(hidden)


class LmTarget(nn.Module):
    def __init__(self, args, vocab_size):
        super().__init__()
        self.output_layer = nn.Linear(args.hidden_size, vocab_size, bias=False)

    def forward(self, memory_bank):
        return self.output_layer(memory_bank)


class Model(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.embedding = Embedding(args, args.vocab_size)
        self.encoder = TransformerEncoder(args)
        self.target = LmTarget(args, args.vocab_size)

    def forward(self, src, seg=None):
        if seg is None:
            seg = torch.ones_like(src)
        return self.target(self.encoder(self.embedding(src, seg), seg))


def make_model():
    torch.manual_seed(0)
    args = SimpleNamespace(emb_size=64, hidden_size=64, heads_num=4, feedforward_size=128, layers_num=3,
                           max_seq_length=64, dropout=0.0, mask="causal", vocab_size=128, kq_layers=(1,))
    model = Model(args)
    for m in model.modules():
        if isinstance(m, nn.LayerNorm):
            nn.init.uniform_(m.weight, 0.6, 1.4)
            nn.init.uniform_(m.bias, -0.1, 0.1)
    return model.eval()

"""A decoder-only language model built from d2l.ai's `TransformerDecoder` chapter (written from
memory, in my own words), without the encoder and the cross-attention: `decoder.blks.blockN`
(`TransformerDecoderBlock` with `attention1`, `addnorm1`, `ffn`, `addnorm3`; post-norm AddNorm),
d2l's `MultiHeadAttention` (W_q/W_k/W_v/W_o without bias, `transpose_qkv` folding heads into the
batch, a `DotProductAttention` submodule with `masked_softmax` that fills with −1e6 beyond each
row's valid length), `PositionalEncoding` table `P`, embeddings × sqrt(num_hiddens), output `dense`.

d2l's decoding state is kept: `state[2][i]` holds every token that has entered block i so far (the
block *inputs*, not keys/values) and each block concatenates the new inputs to it and projects
keys/values from the whole history.  Multi-token calls mask with dec_valid_lens = past + 1 … past + T
(causal); one-token calls pass None (d2l's prediction path: the token sees everything cached).
Cache (book-cache): `cache = mod.KVCache(n_layers=3)` (the `state[2]` list), `model(prompt,
cache=cache)`, then `model(tok, cache=cache)`; a plain `model(tokens)` is the full forward.
4 heads of 16, num_hiddens 64, 3 blocks, vocab 100.  Returns logits (batch, tokens, vocab).

Decode slip (d2l's own): `PositionalEncoding` adds `P[:, :X.shape[1]]` whatever the cache holds, so
every decoded token is embedded at position 0.  decode `cache_positions`, step 0,
`decoder.blks.block0.attention1`.
"""

import math

import torch
import torch.nn as nn

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": [
        "decoder.blks.block0.attention1",
        "decoder.blks.block1.attention1",
        "decoder.blks.block2.attention1",
    ],
    "kind": "causal-multihead",
    "cache": "book-cache",
    "decode": {"mistake": "cache_positions", "step": 0, "layer": "decoder.blks.block0.attention1"},
    "style": "d2l.ai TransformerDecoder (decoder-only): blks block0..2 with attention1/addnorm1/ffn/addnorm3, state[2][i] "
    "caches block inputs, dec_valid_lens masking; slip: pos_encoding adds P[:, :T] with no offset",
}


def sequence_mask(X, valid_len, value=0):
    maxlen = X.size(1)
    mask = torch.arange(maxlen, dtype=torch.float32, device=X.device)[None, :] < valid_len[:, None]
    X[~mask] = value
    return X


def masked_softmax(X, valid_lens):
    if valid_lens is None:
        return nn.functional.softmax(X, dim=-1)
    shape = X.shape
    if valid_lens.dim() == 1:
        valid_lens = torch.repeat_interleave(valid_lens, shape[1])
    else:
        valid_lens = valid_lens.reshape(-1)
    X = sequence_mask(X.reshape(-1, shape[-1]), valid_lens, value=-1e6)
    return nn.functional.softmax(X.reshape(shape), dim=-1)


class DotProductAttention(nn.Module):
    def __init__(self, dropout):
        super().__init__()
        self.dropout = nn.Dropout(dropout)

    def forward(self, queries, keys, values, valid_lens=None):
        d = queries.shape[-1]
        scores = torch.bmm(queries, keys.transpose(1, 2)) / math.sqrt(d)
        self.attention_weights = masked_softmax(scores, valid_lens)
        return torch.bmm(self.dropout(self.attention_weights), values)


def transpose_qkv(X, num_heads):
    X = X.reshape(X.shape[0], X.shape[1], num_heads, -1)
    X = X.permute(0, 2, 1, 3)
    return X.reshape(-1, X.shape[2], X.shape[3])


def transpose_output(X, num_heads):
    X = X.reshape(-1, num_heads, X.shape[1], X.shape[2])
    X = X.permute(0, 2, 1, 3)
    return X.reshape(X.shape[0], X.shape[1], -1)


class MultiHeadAttention(nn.Module):
    def __init__(self, num_hiddens, num_heads, dropout, bias=False):
        super().__init__()
        self.num_heads = num_heads
        self.attention = DotProductAttention(dropout)
        self.W_q = nn.Linear(num_hiddens, num_hiddens, bias=bias)
        self.W_k = nn.Linear(num_hiddens, num_hiddens, bias=bias)
        self.W_v = nn.Linear(num_hiddens, num_hiddens, bias=bias)
        self.W_o = nn.Linear(num_hiddens, num_hiddens, bias=bias)

    def forward(self, queries, keys, values, valid_lens):
        queries = transpose_qkv(self.W_q(queries), self.num_heads)
        keys = transpose_qkv(self.W_k(keys), self.num_heads)
        values = transpose_qkv(self.W_v(values), self.num_heads)
        if valid_lens is not None:
            valid_lens = torch.repeat_interleave(valid_lens, repeats=self.num_heads, dim=0)
        output = self.attention(queries, keys, values, valid_lens)
        return self.W_o(transpose_output(output, self.num_heads))


class PositionWiseFFN(nn.Module):
    def __init__(self, num_hiddens, ffn_num_hiddens):
        super().__init__()
        self.dense1 = nn.Linear(num_hiddens, ffn_num_hiddens)
        self.relu = nn.ReLU()
        self.dense2 = nn.Linear(ffn_num_hiddens, num_hiddens)

    def forward(self, X):
        return self.dense2(self.relu(self.dense1(X)))


class AddNorm(nn.Module):
    def __init__(self, norm_shape, dropout):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.ln = nn.LayerNorm(norm_shape)

    def forward(self, X, Y):
        return self.ln(self.dropout(Y) + X)


class PositionalEncoding(nn.Module):
    def __init__(self, num_hiddens, dropout, max_len=200):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        P = torch.zeros((1, max_len, num_hiddens))
        X = torch.arange(max_len, dtype=torch.float32).reshape(-1, 1) / torch.pow(
            10000, torch.arange(0, num_hiddens, 2, dtype=torch.float32) / num_hiddens
        )
        P[:, :, 0::2] = torch.sin(X)
        P[:, :, 1::2] = torch.cos(X)
        self.register_buffer("P", P)

    def forward(self, X):
        X = X + self.P[:, : X.shape[1], :].to(X.dtype)
        return self.dropout(X)


class TransformerDecoderBlock(nn.Module):
    def __init__(self, num_hiddens, ffn_num_hiddens, num_heads, dropout, i):
        super().__init__()
        self.i = i
        self.attention1 = MultiHeadAttention(num_hiddens, num_heads, dropout)
        self.addnorm1 = AddNorm(num_hiddens, dropout)
        self.ffn = PositionWiseFFN(num_hiddens, ffn_num_hiddens)
        self.addnorm3 = AddNorm(num_hiddens, dropout)

    def forward(self, X, state):
        if state[2][self.i] is None:
            key_values = X
        else:
            key_values = torch.cat((state[2][self.i], X), dim=1)
        past = key_values.shape[1] - X.shape[1]
        state[2][self.i] = key_values
        batch_size, num_steps, _ = X.shape
        if num_steps > 1:
            dec_valid_lens = torch.arange(past + 1, past + num_steps + 1, device=X.device).repeat(
                batch_size, 1
            )
        else:
            dec_valid_lens = None
        X2 = self.attention1(X, key_values, key_values, dec_valid_lens)
        Y = self.addnorm1(X, X2)
        return self.addnorm3(Y, self.ffn(Y)), state


class TransformerDecoder(nn.Module):
    def __init__(self, vocab_size, num_hiddens, ffn_num_hiddens, num_heads, num_blks, dropout):
        super().__init__()
        self.num_hiddens = num_hiddens
        self.num_blks = num_blks
        self.embedding = nn.Embedding(vocab_size, num_hiddens)
        self.pos_encoding = PositionalEncoding(num_hiddens, dropout)
        self.blks = nn.Sequential()
        for i in range(num_blks):
            self.blks.add_module(
                "block" + str(i),
                TransformerDecoderBlock(num_hiddens, ffn_num_hiddens, num_heads, dropout, i),
            )
        self.dense = nn.Linear(num_hiddens, vocab_size)

    def init_state(self):
        return [None, None, [None] * self.num_blks]

    def forward(self, X, state):
        X = self.pos_encoding(self.embedding(X) * math.sqrt(self.num_hiddens))
        for blk in self.blks:
            X, state = blk(X, state)
        return self.dense(X), state


class KVCache(list):
    """d2l's decoder state [enc_outputs, enc_valid_lens, per-block history]."""

    def __init__(self, n_layers):
        super().__init__([None, None, [None] * n_layers])

    def reset(self):
        self[2] = [None] * len(self[2])


class DecoderLM(nn.Module):
    def __init__(
        self,
        vocab_size=100,
        num_hiddens=64,
        ffn_num_hiddens=128,
        num_heads=4,
        num_blks=3,
        dropout=0.1,
    ):
        super().__init__()
        self.decoder = TransformerDecoder(
            vocab_size, num_hiddens, ffn_num_hiddens, num_heads, num_blks, dropout
        )

    def reset_kv_cache(self):
        pass

    def forward(self, tokens, cache=None):
        state = cache if cache is not None else self.decoder.init_state()
        logits, _ = self.decoder(tokens, state)
        return logits


def make_model():
    torch.manual_seed(6112)
    model = DecoderLM()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn_like(m.weight))
                m.bias.copy_(0.1 * torch.randn_like(m.bias))
    return model.eval()

"""labml.ai annotated_deep_learning_paper_implementations: the ALiBi experiment
(labml_nn/transformers/alibi) written in plain torch.

AutoregressiveTransformer: `src_embed` (token embedding only: ALiBi models have no position embedding),
`encoder` (Encoder: `layers.N` TransformerLayer + final `norm`), `generator` (Linear to the vocabulary).
labml works sequence-first: the model takes ids (batch, seq) here and transposes to [seq, batch] inside.
TransformerLayer (pre-norm): `norm_self_attn` -> `self_attn(query=z, key=z, value=z, mask=mask)` ->
+ x; `norm_ff` -> `feed_forward` (layer1 / ReLU / layer2) -> + x.  AlibiMultiHeadAttention (a
MultiHeadAttention subclass): PrepareForMultiHeadAttention `query`/`key`/`value` (Linear with bias, view
[seq, batch, heads, d_k]), scores = einsum('ibhd,jbhd->ijbh') * 1/sqrt(d_k), plus the ALiBi biases
`get_alibi_biases(heads, mask)`: distance = mask.cumsum(dim=-1) (j + 1 for visible keys) times the
standard slopes 2^-2, 2^-4, 2^-6, 2^-8 (per query row this equals -slope * (i - j) up to a constant),
masked_fill(mask == 0, -inf) with the [seq, seq, 1] subsequent mask, `self.softmax` (nn.Softmax(dim=1):
the key axis of [q, k, batch, heads]), einsum('ijbh,jbhd->ibhd'), `output` Linear.  4 heads of 16.
Slip: layer 2's attention is an `AlibiMultiHeadAttention` rebuilt from a batch-first draft whose
`self.softmax = nn.Softmax(dim=0)`: in labml's [q, k, b, h] layout that normalises over queries.
Layers 0 and 1 are correct.  No cache.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["encoder.layers.0.self_attn", "encoder.layers.1.self_attn", "encoder.layers.2.self_attn"],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "encoder.layers.2.self_attn",
    "stage": "weights",
    "mistake": "softmax_wrong_dim",
    "style": "labml.ai ALiBi experiment: sequence-first [q, k, b, h] einsum scores, cumsum-of-mask ALiBi distances with "
    "standard 4-head slopes, PrepareForMultiHeadAttention with bias, pre-LN; layer 2 uses nn.Softmax(dim=0)",
}


class PrepareForMultiHeadAttention(nn.Module):
    def __init__(self, d_model, heads, d_k, bias=True):
        super().__init__()
        self.linear = nn.Linear(d_model, heads * d_k, bias=bias)
        self.heads = heads
        self.d_k = d_k

    def forward(self, x):
        head_shape = x.shape[:-1]
        x = self.linear(x)
        return x.view(*head_shape, self.heads, self.d_k)


def get_slopes(n_heads):
    n = 2 ** math.floor(math.log2(n_heads))
    m_0 = 2.0 ** (-8.0 / n)
    m = torch.pow(m_0, torch.arange(1, 1 + n, dtype=torch.float64))
    if n < n_heads:
        m_hat_0 = 2.0 ** (-4.0 / n)
        m_hat = torch.pow(m_hat_0, torch.arange(1, 1 + 2 * (n_heads - n), 2, dtype=torch.float64))
        m = torch.cat([m, m_hat])
    return m


def get_alibi_biases(n_heads, mask):
    m = get_slopes(n_heads).to(mask.device)
    distance = mask[:, :, 0].to(torch.float64).cumsum(dim=-1)
    return distance[:, :, None] * m[None, None, :]


class MultiHeadAttention(nn.Module):
    def __init__(self, heads, d_model, bias=True, softmax_dim=1):
        super().__init__()
        self.d_k = d_model // heads
        self.heads = heads
        self.query = PrepareForMultiHeadAttention(d_model, heads, self.d_k, bias=bias)
        self.key = PrepareForMultiHeadAttention(d_model, heads, self.d_k, bias=bias)
        self.value = PrepareForMultiHeadAttention(d_model, heads, self.d_k, bias=True)
        self.softmax = nn.Softmax(dim=softmax_dim)
        self.output = nn.Linear(d_model, d_model)
        self.scale = 1 / math.sqrt(self.d_k)

    def get_scores(self, query, key):
        return torch.einsum("ibhd,jbhd->ijbh", query, key)

    def prepare_mask(self, mask, query_shape, key_shape):
        return mask.unsqueeze(-1)


class AlibiMultiHeadAttention(MultiHeadAttention):
    def forward(self, *, query, key, value, mask=None):
        seq_len, batch_size, _ = query.shape
        query = self.query(query)
        key = self.key(key)
        value = self.value(value)
        scores = self.get_scores(query, key)
        scores = scores * self.scale
        alibi = get_alibi_biases(self.heads, mask).to(scores.dtype)
        scores = scores + alibi[:seq_len, : key.shape[0], None, :]
        mask = self.prepare_mask(mask, query.shape, key.shape)
        scores = scores.masked_fill(mask == 0, float("-inf"))
        attn = self.softmax(scores)
        x = torch.einsum("ijbh,jbhd->ibhd", attn, value)
        x = x.reshape(seq_len, batch_size, -1)
        return self.output(x)


class FeedForward(nn.Module):
    def __init__(self, d_model, d_ff):
        super().__init__()
        self.layer1 = nn.Linear(d_model, d_ff)
        self.layer2 = nn.Linear(d_ff, d_model)

    def forward(self, x):
        return self.layer2(F.relu(self.layer1(x)))


class TransformerLayer(nn.Module):
    def __init__(self, d_model, self_attn, feed_forward):
        super().__init__()
        self.self_attn = self_attn
        self.feed_forward = feed_forward
        self.norm_self_attn = nn.LayerNorm([d_model])
        self.norm_ff = nn.LayerNorm([d_model])

    def forward(self, *, x, mask):
        z = self.norm_self_attn(x)
        x = x + self.self_attn(query=z, key=z, value=z, mask=mask)
        return x + self.feed_forward(self.norm_ff(x))


class Encoder(nn.Module):
    def __init__(self, layers, d_model):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.norm = nn.LayerNorm([d_model])

    def forward(self, x, mask):
        for layer in self.layers:
            x = layer(x=x, mask=mask)
        return self.norm(x)


def subsequent_mask(seq_len, device):
    return torch.tril(torch.ones(seq_len, seq_len, device=device)).to(torch.bool).unsqueeze(-1)


class AutoregressiveTransformer(nn.Module):
    def __init__(self, n_vocab=96, d_model=64, heads=4, n_layers=3, d_ff=128):
        super().__init__()
        layers = []
        for i in range(n_layers):
            attn = AlibiMultiHeadAttention(heads, d_model, softmax_dim=(0 if i == 2 else 1))
            layers.append(TransformerLayer(d_model, attn, FeedForward(d_model, d_ff)))
        self.src_embed = nn.Embedding(n_vocab, d_model)
        self.encoder = Encoder(layers, d_model)
        self.generator = nn.Linear(d_model, n_vocab)

    def forward(self, x):
        x = x.transpose(0, 1)  # (batch, seq) ids -> labml's [seq, batch]
        mask = subsequent_mask(x.shape[0], x.device)
        res = self.encoder(self.src_embed(x), mask)
        return self.generator(res).transpose(0, 1)


def make_model():
    torch.manual_seed(1509)
    model = AutoregressiveTransformer()
    g = torch.Generator().manual_seed(15091)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model.eval()

"""labml AlibiMultiHeadAttention with the bias subtracted: scores -= distance * slope,
where distance = mask.cumsum(-1) = j + 1, so later keys are penalised and distant keys
favoured (= +slope * (i - j) up to a per-query constant).
"""

import math

import torch
from torch import nn


class PrepareForMultiHeadAttention(nn.Module):
    def __init__(self, d_model, heads, d_k, bias):
        super().__init__()
        self.linear = nn.Linear(d_model, heads * d_k, bias=bias)
        self.heads = heads
        self.d_k = d_k

    def forward(self, x):
        head_shape = x.shape[:-1]
        x = self.linear(x)
        return x.view(*head_shape, self.heads, self.d_k)


def get_slopes(n_heads: int):
    n = 2 ** math.floor(math.log2(n_heads))
    m_0 = 2.0 ** (-8.0 / n)
    m = torch.pow(m_0, torch.arange(1, 1 + n))
    if n < n_heads:
        m_hat_0 = 2.0 ** (-4.0 / n)
        m_hat = torch.pow(m_hat_0, torch.arange(1, 1 + 2 * (n_heads - n), 2))
        m = torch.cat([m, m_hat])
    return m


@torch.no_grad()
def get_alibi_biases(n_heads: int, mask: torch.Tensor):
    m = get_slopes(n_heads).to(mask.device)
    distance = mask.cumsum(dim=-1)
    return distance[:, :, None] * m[None, None, :]


class AlibiMultiHeadAttention(nn.Module):
    def __init__(self, heads, d_model, dropout_prob=0.0):
        super().__init__()
        self.d_k = d_model // heads
        self.heads = heads
        self.query = PrepareForMultiHeadAttention(d_model, heads, self.d_k, bias=True)
        self.key = PrepareForMultiHeadAttention(d_model, heads, self.d_k, bias=True)
        self.value = PrepareForMultiHeadAttention(d_model, heads, self.d_k, bias=True)
        self.softmax = nn.Softmax(dim=1)
        self.output = nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(dropout_prob)
        self.scale = 1 / math.sqrt(self.d_k)
        self.alibi_biases = None

    def forward(self, *, query, key, value, mask=None):
        assert mask is not None
        assert mask.shape[0] == mask.shape[1] and mask.shape[2] == 1
        seq_len, batch_size, _ = query.shape
        mask = mask.unsqueeze(-1)
        query = self.query(query)
        key = self.key(key)
        value = self.value(value)
        scores = torch.einsum("ibhd,jbhd->ijbh", query, key)
        scores *= self.scale
        if self.alibi_biases is None or self.alibi_biases.shape[1] < seq_len:
            self.alibi_biases = get_alibi_biases(scores.shape[-1], mask[:, :, 0, 0])
        scores -= self.alibi_biases[:seq_len, :seq_len, None, :].to(scores.dtype)
        scores = scores.masked_fill(mask == 0, float("-inf"))
        attn = self.softmax(scores)
        attn = self.dropout(attn)
        x = torch.einsum("ijbh,jbhd->ibhd", attn, value)
        x = x.reshape(seq_len, batch_size, -1)
        return self.output(x)


def subsequent_mask(seq_len):
    return torch.tril(torch.ones(seq_len, seq_len)).to(torch.bool).unsqueeze(-1)


class TransformerLayer(nn.Module):
    def __init__(self, d_model=48, heads=6):
        super().__init__()
        self.self_attn = AlibiMultiHeadAttention(heads, d_model)
        self.norm_self_attn = nn.LayerNorm([d_model])

    def forward(self, *, x, mask):
        z = self.norm_self_attn(x)
        return x + self.self_attn(query=z, key=z, value=z, mask=mask)


class BatchFirstAlibiDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = TransformerLayer()

    def forward(self, x):
        x = x.transpose(0, 1)
        # a fixed-size mask, as labml's experiment builds it once for the context length
        mask = subsequent_mask(64)[: x.shape[0], : x.shape[0]]
        return self.layer(x=x, mask=mask).transpose(0, 1)


def make_labml_alibi():
    torch.manual_seed(117)
    dec = BatchFirstAlibiDecoder()
    with torch.no_grad():
        dec.layer.norm_self_attn.weight.uniform_(0.5, 1.5)
        dec.layer.norm_self_attn.bias.uniform_(-0.1, 0.1)
    return dec.eval()


EXPECT = {
    "target": "make_labml_alibi",
    "kind": "causal-multihead",
    "ok": False,
    "layer": "layer.self_attn",
    "stage": "biased_scores",
    "mistake": "bias_sign",
    "style": "labml.ai AlibiMultiHeadAttention (sequence-first, 6 heads): key-position bias subtracted instead of added",
}

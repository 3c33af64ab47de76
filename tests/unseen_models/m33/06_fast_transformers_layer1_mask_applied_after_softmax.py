"""An autoregressive LM built from idiap/fast-transformers pieces (FullAttention, AttentionLayer,
TransformerEncoderLayer, RecurrentFullAttention), the way the library's examples build one.

CausalTransformerLM: value_embedding, pos_embedding (sinusoid, sin on even / cos on odd features,
float64 at call time), transformer (TransformerEncoder: layers.N, final norm), predictor.
TransformerEncoderLayer is post-norm (norm1(x + attention), norm2(x + ffn)).  AttentionLayer:
query/key/value/out_projection with bias, heads split by view(N, L, H, -1); FullAttention:
einsum 'nlhe,nshe->nhls', + TriangularCausalMask.additive_matrix (0 / -inf via log),
softmax(softmax_temp * QK) with softmax_temp = 1/sqrt(E), einsum 'nhls,nshd->nlhd'.
`inner_attention` / `recurrent_inner_attention` are parameter-free parts of `attention`.
Slip: layer 1 is built with `mask_after_softmax=True`: the weights are the unmasked softmax
times TriangularCausalMask.float_matrix (rows no longer sum to 1).  The softmax normaliser
still sums over later tokens, so layer 1 is not causal: the prompt pass and the cached steps
differ from a full pass over a longer sequence.  The expected report is the attention slip.
Cache: hf: `out = model(prompt, use_cache=True)`, then
`out = model(tok, past_key_values=out.past_key_values, use_cache=True)`; logits in `out.logits`.
`past_key_values` is fast-transformers' recurrent state: a list with one [keys, values] pair per
layer, each (b, heads, T, 16).  Without a state the batch path runs (FullAttention with a
TriangularCausalMask); with one, tokens go one at a time through RecurrentFullAttention.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": [
        "transformer.layers.0.attention",
        "transformer.layers.1.attention",
        "transformer.layers.2.attention",
    ],
    "kind": "causal-multihead",
    "cache": "hf",
    "layer": "transformer.layers.1.attention",
    "stage": "weights",
    "mistake": "mask_after_softmax",
    "style": "fast-transformers as 02; layer 1's FullAttention multiplies softmax(temp * QK) by the "
    "1/0 causal float_matrix instead of adding the -inf additive_matrix before it",
}


class TriangularCausalMask:
    """fast_transformers.masking.TriangularCausalMask: bool lower triangle, additive 0 / -inf."""

    def __init__(self, n, dtype, device=None):
        self.bool_matrix = torch.tril(torch.ones(n, n, dtype=torch.bool, device=device))
        self.float_matrix = self.bool_matrix.to(dtype)
        self.additive_matrix = torch.log(self.float_matrix)
        self.all_ones = n == 1


class LengthMask:
    """fast_transformers.masking.LengthMask for full-length rows (nothing hidden)."""

    def __init__(self, lengths, max_len, dtype):
        self.lengths = lengths
        idx = torch.arange(max_len, device=lengths.device)
        self.bool_matrix = idx[None, :] < lengths[:, None]
        self.additive_matrix = torch.log(self.bool_matrix.to(dtype))
        self.all_ones = bool(self.bool_matrix.all())


class FullAttention(nn.Module):
    """fast_transformers.attention.FullAttention (no parameters)."""

    def __init__(
        self, softmax_temp=None, attention_dropout=0.0, mask_after_softmax=False
    ):
        super().__init__()
        self.softmax_temp = softmax_temp
        self.dropout = nn.Dropout(attention_dropout)
        self.mask_after_softmax = mask_after_softmax

    def forward(self, queries, keys, values, attn_mask, query_lengths, key_lengths):
        E = queries.shape[-1]
        softmax_temp = self.softmax_temp or 1.0 / math.sqrt(E)
        QK = torch.einsum("nlhe,nshe->nhls", queries, keys)
        if not self.mask_after_softmax and not attn_mask.all_ones:
            QK = QK + attn_mask.additive_matrix
        if not key_lengths.all_ones:
            QK = QK + key_lengths.additive_matrix[:, None, None]
        A = self.dropout(torch.softmax(softmax_temp * QK, dim=-1))
        if self.mask_after_softmax:
            A = A * attn_mask.float_matrix
        V = torch.einsum("nhls,nshd->nlhd", A, values)
        return V.contiguous()


class RecurrentFullAttention(nn.Module):
    """fast_transformers.recurrent.attention.RecurrentFullAttention: state = [keys, values]."""

    def __init__(self, softmax_temp=None, dropout_rate=0.0):
        super().__init__()
        self.softmax_temp = softmax_temp
        self.dropout = nn.Dropout(dropout_rate)

    def forward(self, query, key, value, state=None):
        E = query.shape[-1]
        softmax_temp = self.softmax_temp or 1.0 / math.sqrt(E)
        if state is not None:
            keys, values = state
            keys = torch.cat([keys, key[:, :, None]], dim=2)
            values = torch.cat([values, value[:, :, None]], dim=2)
        else:
            keys = key[:, :, None]
            values = value[:, :, None]
        QK = torch.einsum("nhe,nhse->nhs", query, keys)
        A = self.dropout(torch.softmax(softmax_temp * QK, dim=-1))
        V = torch.einsum("nhs,nhsd->nhd", A, values).contiguous()
        return V, [keys, values]


class AttentionLayer(nn.Module):
    """fast_transformers AttentionLayer and RecurrentAttentionLayer in one module.

    The library keeps the batch and the recurrent layers apart and shares their weights through
    the state dict; here one module holds the projections and both inner attentions, so the
    prompt (batch path) and the one-token steps (recurrent path) go through the same module.
    """

    def __init__(
        self,
        attention,
        recurrent_attention,
        d_model,
        n_heads,
        append_before_inner=False,
    ):
        super().__init__()
        d_keys = d_model // n_heads
        self.inner_attention = attention
        self.recurrent_inner_attention = recurrent_attention
        self.query_projection = nn.Linear(d_model, d_keys * n_heads)
        self.key_projection = nn.Linear(d_model, d_keys * n_heads)
        self.value_projection = nn.Linear(d_model, d_keys * n_heads)
        self.out_projection = nn.Linear(d_keys * n_heads, d_model)
        self.n_heads = n_heads
        self.append_before_inner = append_before_inner

    def forward(
        self,
        queries,
        keys,
        values,
        attn_mask=None,
        query_lengths=None,
        key_lengths=None,
        state=None,
        return_state=False,
    ):
        N, L, _ = queries.shape
        _, S, _ = keys.shape
        H = self.n_heads
        if state is None:
            q = self.query_projection(queries).view(N, L, H, -1)
            k = self.key_projection(keys).view(N, S, H, -1)
            v = self.value_projection(values).view(N, S, H, -1)
            if attn_mask is None:
                attn_mask = TriangularCausalMask(L, q.dtype, q.device)
            if query_lengths is None:
                full = torch.full((N,), L, dtype=torch.long, device=q.device)
                query_lengths = key_lengths = LengthMask(full, L, q.dtype)
            new_values = self.inner_attention(
                q, k, v, attn_mask, query_lengths, key_lengths
            )
            out = self.out_projection(new_values.view(N, L, -1))
            if not return_state:
                return out
            return out, [
                k.permute(0, 2, 1, 3).contiguous(),
                v.permute(0, 2, 1, 3).contiguous(),
            ]
        # recurrent path, one token at a time (RecurrentAttentionLayer)
        outs = []
        for t in range(L):
            q = self.query_projection(queries[:, t]).view(N, H, -1)
            k = self.key_projection(keys[:, t]).view(N, H, -1)
            v = self.value_projection(values[:, t]).view(N, H, -1)
            if self.append_before_inner:
                state = [
                    torch.cat([state[0], k[:, :, None]], dim=2),
                    torch.cat([state[1], v[:, :, None]], dim=2),
                ]
            new_value, state = self.recurrent_inner_attention(q, k, v, state)
            outs.append(self.out_projection(new_value.view(N, -1)))
        return torch.stack(outs, dim=1), state


class TransformerEncoderLayer(nn.Module):
    """fast_transformers.transformers.TransformerEncoderLayer: post-norm."""

    def __init__(self, attention, d_model, d_ff, activation="gelu"):
        super().__init__()
        self.attention = attention
        self.linear1 = nn.Linear(d_model, d_ff)
        self.linear2 = nn.Linear(d_ff, d_model)
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(0.0)
        self.activation = F.relu if activation == "relu" else F.gelu

    def forward(self, x, state=None, return_state=False):
        if return_state:
            a, state = self.attention(x, x, x, state=state, return_state=True)
        else:
            a = self.attention(x, x, x)
        x = x + self.dropout(a)
        y = x = self.norm1(x)
        y = self.dropout(self.activation(self.linear1(y)))
        y = self.dropout(self.linear2(y))
        return self.norm2(x + y), state


class TransformerEncoder(nn.Module):
    def __init__(self, layers, norm_layer=None):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.norm = norm_layer

    def forward(self, x, state=None, return_state=False):
        new_state = []
        for i, layer in enumerate(self.layers):
            x, s = layer(
                x, state=None if state is None else state[i], return_state=return_state
            )
            new_state.append(s)
        if self.norm is not None:
            x = self.norm(x)
        return x, (new_state if return_state else None)


class PositionalEncoding(nn.Module):
    """The sinusoid of the fast-transformers examples: pe[:, 0::2] = sin, pe[:, 1::2] = cos."""

    def __init__(self, d_model, max_len=64):
        super().__init__()
        self.d_model = d_model
        self.max_len = max_len

    def forward(self, x, offset=0):
        length = x.size(1)
        if offset + length > self.max_len:
            raise ValueError("more positions than max_len")
        position = torch.arange(
            offset, offset + length, dtype=torch.float64, device=x.device
        )
        div_term = torch.exp(
            torch.arange(0, self.d_model, 2, dtype=torch.float64, device=x.device)
            * (-math.log(10000.0) / self.d_model)
        )
        pe = torch.zeros(length, self.d_model, dtype=torch.float64, device=x.device)
        pe[:, 0::2] = torch.sin(position[:, None] * div_term)
        pe[:, 1::2] = torch.cos(position[:, None] * div_term)
        return x + pe.to(x.dtype)[None]


class CausalTransformerLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        d = config.d_model
        self.value_embedding = nn.Embedding(config.vocab_size, d)
        self.pos_embedding = PositionalEncoding(d, config.max_len)
        layers = []
        for i in range(config.n_layers):
            attention = FullAttention(
                mask_after_softmax=i in config.mask_after_softmax_layers
            )
            recurrent = RecurrentFullAttention(
                softmax_temp=config.recurrent_softmax_temp
            )
            layers.append(
                TransformerEncoderLayer(
                    AttentionLayer(
                        attention,
                        recurrent,
                        d,
                        config.n_heads,
                        append_before_inner=config.append_before_inner,
                    ),
                    d,
                    config.d_ff,
                )
            )
        self.transformer = TransformerEncoder(layers, nn.LayerNorm(d))
        self.predictor = nn.Linear(d, config.vocab_size)
        self.max_len = config.max_len

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        offset = 0 if past_key_values is None else past_key_values[0][0].shape[2]
        if (
            past_key_values is not None
            and past_key_values[0][0].shape[0] != input_ids.shape[0]
        ):
            raise ValueError("the state was started with another batch size")
        x = self.pos_embedding(self.value_embedding(input_ids), offset)
        want_state = use_cache or past_key_values is not None
        x, state = self.transformer(x, state=past_key_values, return_state=want_state)
        return SimpleNamespace(logits=self.predictor(x), past_key_values=state)


def make_model():
    torch.manual_seed(3306)
    config = SimpleNamespace(
        vocab_size=96,
        d_model=64,
        n_heads=4,
        d_ff=128,
        n_layers=3,
        max_len=64,
        mask_after_softmax_layers=(),
        recurrent_softmax_temp=None,
        append_before_inner=False,
    )
    config.mask_after_softmax_layers = (1,)
    model = CausalTransformerLM(config)
    g = torch.Generator().manual_seed(3306 * 10 + 1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model.eval()

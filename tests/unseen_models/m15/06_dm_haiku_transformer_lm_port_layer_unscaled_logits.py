"""dm-haiku's examples/transformer (model.py) language model, ported to torch module by module.

LanguageModel: `token_embedding_map` (hk.Embed), `positional_embeddings` (a learned parameter
[max_seq_len, d_model]), `transformer` and `output` (hk.Linear to the vocabulary).  Transformer keeps
haiku's per-call modules as explicit lists: `attn_blocks.N` (hk.MultiHeadAttention), `attn_norms.N`,
`dense_blocks.N` (Linear(widening 4) -> gelu -> Linear) and `dense_norms.N` (hk.LayerNorm with scale and
offset), plus `final_norm`; pre-norm residual blocks.  hk.MultiHeadAttention: `query`/`key`/`value`
projections to (..., T, H, K) (key_size 16, 4 heads), attn_logits = einsum("...thd,...Thd->...htT")
then `/ sqrt(key_size)`, jnp.where(mask, logits, -1e30) with the causal mask np.tril(ones(T, T)),
softmax, einsum("...htT,...Thd->...thd"), reshape, `linear` output.  The example's padding-token key mask
is not built (no pad token).  No cache.
Slip: the last block's attention was built with `logit_scale=1.0` (left from trying
jax.nn.dot_product_attention with scale=1.0): its logits are never divided by sqrt(key_size).
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["transformer.attn_blocks.0", "transformer.attn_blocks.1", "transformer.attn_blocks.2"],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "transformer.attn_blocks.2",
    "stage": "scaled_scores",
    "mistake": "missing_scale",
    "style": "dm-haiku examples/transformer LM: learned positional_embeddings parameter, hk.MultiHeadAttention "
    "query/key/value/linear with (T, H, K) einsums and -1e30 where-mask, pre-LN with offset; block 2 keeps "
    "logit_scale=1.0 (no 1/sqrt(key_size))",
}


class MultiHeadAttention(nn.Module):
    def __init__(self, num_heads, key_size, model_size, logit_scale=None):
        super().__init__()
        self.num_heads = num_heads
        self.key_size = key_size
        self.logit_scale = logit_scale
        self.query = nn.Linear(model_size, num_heads * key_size)
        self.key = nn.Linear(model_size, num_heads * key_size)
        self.value = nn.Linear(model_size, num_heads * key_size)
        self.linear = nn.Linear(num_heads * key_size, model_size)

    def _linear_projection(self, x, proj):
        y = proj(x)
        return y.reshape(*x.shape[:-1], self.num_heads, self.key_size)

    def forward(self, query, key, value, mask=None):
        query_heads = self._linear_projection(query, self.query)
        key_heads = self._linear_projection(key, self.key)
        value_heads = self._linear_projection(value, self.value)
        attn_logits = torch.einsum("...thd,...Thd->...htT", query_heads, key_heads)
        if self.logit_scale is None:
            attn_logits = attn_logits / math.sqrt(self.key_size)
        else:
            attn_logits = attn_logits * self.logit_scale
        if mask is not None:
            attn_logits = torch.where(mask, attn_logits, torch.full_like(attn_logits, -1e30))
        attn_weights = torch.softmax(attn_logits, dim=-1)
        attn = torch.einsum("...htT,...Thd->...thd", attn_weights, value_heads)
        attn = attn.reshape(*query.shape[:-1], -1)
        return self.linear(attn)


class Transformer(nn.Module):
    def __init__(self, num_heads, num_layers, attn_size, model_size, widening_factor=4, logit_scales=None):
        super().__init__()
        logit_scales = logit_scales or [None] * num_layers
        self.attn_blocks = nn.ModuleList(
            [MultiHeadAttention(num_heads, attn_size, model_size, logit_scales[i]) for i in range(num_layers)]
        )
        self.attn_norms = nn.ModuleList([nn.LayerNorm(model_size) for _ in range(num_layers)])
        self.dense_blocks = nn.ModuleList(
            [nn.Sequential(nn.Linear(model_size, widening_factor * model_size), nn.GELU(),
                           nn.Linear(widening_factor * model_size, model_size)) for _ in range(num_layers)]
        )
        self.dense_norms = nn.ModuleList([nn.LayerNorm(model_size) for _ in range(num_layers)])
        self.final_norm = nn.LayerNorm(model_size)

    def forward(self, embeddings):
        seq_len = embeddings.shape[1]
        causal_mask = torch.tril(torch.ones(1, 1, seq_len, seq_len, dtype=torch.bool, device=embeddings.device))
        h = embeddings
        for attn, an, dense, dn in zip(self.attn_blocks, self.attn_norms, self.dense_blocks, self.dense_norms):
            h_norm = an(h)
            h = h + attn(h_norm, h_norm, h_norm, mask=causal_mask)
            h = h + dense(dn(h))
        return self.final_norm(h)


class LanguageModel(nn.Module):
    def __init__(self, vocab_size=96, d_model=64, num_heads=4, num_layers=3, max_seq_len=64):
        super().__init__()
        self.token_embedding_map = nn.Embedding(vocab_size, d_model)
        self.positional_embeddings = nn.Parameter(torch.randn(max_seq_len, d_model) * 0.5)
        self.transformer = Transformer(num_heads, num_layers, d_model // num_heads, d_model,
                                       logit_scales=[None, None, 1.0])
        self.output = nn.Linear(d_model, vocab_size)

    def forward(self, tokens):
        seq_len = tokens.shape[1]
        input_embeddings = self.token_embedding_map(tokens) + self.positional_embeddings[:seq_len]
        return self.output(self.transformer(input_embeddings))


def make_model():
    torch.manual_seed(1506)
    model = LanguageModel()
    g = torch.Generator().manual_seed(15061)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model.eval()

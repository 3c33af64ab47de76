"""Jukebox's autoregressive prior (openai/jukebox, transformers' modeling_jukebox.py) as a token
LM.

JukeboxPrior -> prior (JukeboxConditionalAutoregressive: embed_tokens, pos_emb =
JukeboxPositionalEmbedding
holding a learned (n_ctx, width) `pos_emb`, transformer = JukeboxLayerStack with blocks in
`_attn_mods`,
fc_proj_out).  JukeboxBlock: layer_norm_0 -> attn, layer_norm_1 -> mlp, output = residual +
attn + mlp.
JukeboxAttention ("dense_attn"): one Conv1D `c_attn` (weight (in, out)) chunked into q | k | v,
split_heads with the keys permuted to (b, heads, head_dim, len), query and key each multiplied
by
1/sqrt(sqrt(head_dim)), the tril mask applied multiplicatively (w * mask - 1e9 * (1 - mask)) and
skipped for a single query, softmax, merge_heads, Conv1D `c_proj`.  MHA 4/4, width 64, no
rotary.
Cache: book-buffers.  `model.reset_kv_cache()` (del_cache on every attention), then
`model(ids, use_cache=True)` = Jukebox's sample=True: each attention advances its `sample_t` and
appends k/v to its `cache` dict (_append_cache, concatenation on dim 1); positions come from
pos_emb()[sample_t : sample_t + n].  Returns the logits tensor.
Slip: the one-token sampling branch indexes pos_emb with the step length (row n - 1 = 0)
instead of
sample_t, so every decoded token gets position 0's embedding.  Prompt calls (n > 1) and the
full pass
use the right rows; caches and masks are right."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": [
        "prior.transformer._attn_mods.0.attn",
        "prior.transformer._attn_mods.1.attn",
        "prior.transformer._attn_mods.2.attn",
    ],
    "kind": "causal-multihead",
    "cache": "book-buffers",
    "decode": {
        "mistake": "cache_positions",
        "step": 0,
        "layer": "prior.transformer._attn_mods.0.attn",
    },
    "style": "openai/jukebox (transformers modeling_jukebox.py) prior: Conv1D c_attn/c_proj (in, "
    "out) weights, qkv chunk(3), split_heads with keys as (b, h, d, len), q and k each "
    "scaled by head_dim**-0.25, multiplicative w*mask - 1e9*(1-mask) tril mask (None for "
    "one query), learned pos_emb sliced at sample_t, per-module cache dict concatenated "
    "by _append_cache, del_cache; slip: one-token sampling reads pos_emb()[n - 1 : n] "
    "(position 0) instead of sample_t",
}


class Conv1D(nn.Module):
    # OpenAI-style Conv1D: weight (n_in, n_out), y = x @ w + b
    def __init__(self, n_in, n_out):
        super().__init__()
        self.n_out = n_out
        self.weight = nn.Parameter(torch.randn(n_in, n_out) / math.sqrt(n_in))
        self.bias = nn.Parameter(0.02 * torch.randn(n_out))

    def forward(self, x):
        size_out = (*x.size()[:-1], self.n_out)
        x = torch.addmm(self.bias.type_as(x), x.reshape(-1, x.size(-1)), self.weight.type_as(x))
        return x.view(*size_out)


def get_mask(q_l, kv_l, sample, sample_t, device):
    # 1 x 1 x q_l x kv_l lower-triangular mask, or None when a single query may see everything
    if q_l == 1:
        return None
    offset = sample_t - q_l if sample else max(kv_l - q_l, 0)
    return torch.ones(q_l, kv_l, device=device).tril(offset).view(1, 1, q_l, kv_l)


class JukeboxAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.width = config.width
        self.n_heads = config.n_heads
        self.head_dim = config.width // config.n_heads
        self.n_ctx = config.n_ctx
        self.c_attn = Conv1D(config.width, 3 * config.width)
        self.c_proj = Conv1D(config.width, config.width)
        self.sample_t = 0
        self.cache = {}

    def split_heads(self, x, k=False):
        new_shape = (*x.size()[:-1], self.n_heads, x.size(-1) // self.n_heads)
        x = x.view(*new_shape)
        if k:
            return x.permute(0, 2, 3, 1)  # (b, heads, head_dim, len)
        return x.permute(0, 2, 1, 3)

    def merge_heads(self, x):
        x = x.permute(0, 2, 1, 3).contiguous()
        return x.view(*x.size()[:-2], x.size(-2) * x.size(-1))

    def _attn(self, query, key, value, sample):
        scale = 1.0 / math.sqrt(math.sqrt(self.head_dim))
        weights = torch.matmul(query * scale, key * scale)
        mask = get_mask(query.size(-2), key.size(-1), sample, self.sample_t, query.device)
        if mask is not None:
            mask = mask.to(weights.dtype)
            weights = weights * mask + -1e9 * (1 - mask)
        probs = F.softmax(weights, dim=-1)
        return torch.matmul(probs, value)

    def dense_attn(self, query, key, value, sample):
        query = self.split_heads(query)
        key = self.split_heads(key, k=True)
        value = self.split_heads(value)
        return self.merge_heads(self._attn(query, key, value, sample))

    def _append_cache(self, key, value):
        if "key" not in self.cache:
            self.cache["key"] = key
            self.cache["value"] = value
        else:
            self.cache["key"] = torch.cat([self.cache["key"], key], dim=1)
            self.cache["value"] = torch.cat([self.cache["value"], value], dim=1)
        return self.cache["key"], self.cache["value"]

    def del_cache(self):
        self.sample_t = 0
        self.cache = {}

    def forward(self, hidden_states, sample=False):
        curr_ctx = hidden_states.shape[1]
        hidden_states = self.c_attn(hidden_states)
        query, key, value = hidden_states.chunk(3, dim=2)
        if sample:
            if self.sample_t + curr_ctx > self.n_ctx:
                raise ValueError("sampling past n_ctx")
            self.sample_t += curr_ctx
            key, value = self._append_cache(key, value)
        return self.c_proj(self.dense_attn(query, key, value, sample))


ATTN_CLASSES = {"dense_attn": JukeboxAttention}


class JukeboxMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = Conv1D(config.width, 4 * config.width)
        self.c_proj = Conv1D(4 * config.width, config.width)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class JukeboxBlock(nn.Module):
    def __init__(self, config, attn_cls):
        super().__init__()
        self.attn = attn_cls(config)
        self.layer_norm_0 = nn.LayerNorm(config.width)
        self.mlp = JukeboxMLP(config)
        self.layer_norm_1 = nn.LayerNorm(config.width)

    def forward(self, hidden_states, sample=False):
        residuals = hidden_states
        hidden_states = self.attn(self.layer_norm_0(hidden_states), sample)
        output_states = self.mlp(self.layer_norm_1(residuals + hidden_states))
        return residuals + hidden_states + output_states


class JukeboxLayerStack(nn.Module):
    def __init__(self, config):
        super().__init__()
        self._attn_mods = nn.ModuleList(
            [JukeboxBlock(config, ATTN_CLASSES[name]) for name in config.attn_funcs]
        )

    def forward(self, hidden_states, sample=False):
        for block in self._attn_mods:
            hidden_states = block(hidden_states, sample=sample)
        return hidden_states

    def del_cache(self):
        for block in self._attn_mods:
            block.attn.del_cache()


class JukeboxPositionalEmbedding(nn.Module):
    def __init__(self, n_ctx, width):
        super().__init__()
        self.pos_emb = nn.Parameter(torch.randn(n_ctx, width) * 0.5)

    def forward(self):
        return self.pos_emb


class JukeboxConditionalAutoregressive(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.width)
        self.pos_emb = JukeboxPositionalEmbedding(config.n_ctx, config.width)
        self.transformer = JukeboxLayerStack(config)
        self.fc_proj_out = nn.Linear(config.width, config.vocab_size, bias=False)

    def forward(self, tokens, sample=False):
        n = tokens.shape[1]
        hidden_states = self.embed_tokens(tokens)
        if sample:
            sample_t = self.transformer._attn_mods[0].attn.sample_t
            start = sample_t if n > 1 else n - 1
            pos = self.pos_emb()[start : start + n]
        else:
            pos = self.pos_emb()[:n]
        hidden_states = hidden_states + pos.to(hidden_states.dtype)
        hidden_states = self.transformer(hidden_states, sample=sample)
        return self.fc_proj_out(hidden_states)


class JukeboxPrior(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.prior = JukeboxConditionalAutoregressive(config)

    def reset_kv_cache(self):
        self.prior.transformer.del_cache()

    def forward(self, tokens, use_cache=False):
        return self.prior(tokens, sample=use_cache)


def make_model():
    torch.manual_seed(2910)
    config = _Config(
        vocab_size=96,
        width=64,
        n_heads=4,
        n_ctx=64,
        attn_funcs=["dense_attn", "dense_attn", "dense_attn"],
    )
    model = JukeboxPrior(config)
    g = torch.Generator().manual_seed(29101)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model.eval()


class _Config:
    def __init__(self, **kw):
        self.__dict__.update(kw)

"""XLM as a causal LM, in the shape of transformers' modeling_xlm.py (written from memory, in my own
words): `transformer` holds *parallel ModuleLists* `attentions`, `layer_norm1`, `ffns`,
`layer_norm2` (post-norm: tensor + attn → layer_norm1 → + ffn → layer_norm2), learned
`position_embeddings`, `embeddings`, `layer_norm_emb`; `MultiHeadAttention` with q_lin/k_lin/v_lin/
out_lin, a class-level `NEW_ID` counter giving each attention its `layer_id`, queries divided by
sqrt(dim_per_head) before the product, a boolean causal `attn_mask` (alen <= position) turned into
masked_fill(finfo.min); `pred_layer.proj` tied to the embeddings.  `causal = True`, 3 layers,
emb_dim 64, 4 heads, vocab 120, gelu FFN.

Cache (book-cache; XLM's own convention): a dict with `cache["slen"]` (tokens seen) and one
(k, v) entry per `layer_id`; the model adds `slen` to the positions and advances it after each
call.  Drive: `cache = mod.KVCache(n_layers=3)` (a dict starting at {"slen": 0}),
`model(prompt, cache=cache)`, then `model(tok, cache=cache)` with only the new tokens (real XLM
re-passes the whole prefix and slices it; this copy takes the new tokens only).  A plain
`model(tokens)` is the full forward.  Returns an object with `.logits`.

Decode slip: the line that stores `(k, v)` back into the cache sits in the `else` branch (only the
first call stores anything), so decoded tokens are used once and never kept: step 0 is right, step 1
misses step 0's key.  decode `cache_stale`, step 1, `transformer.attentions.0`.
"""

import itertools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["transformer.attentions.0", "transformer.attentions.1", "transformer.attentions.2"],
    "kind": "causal-multihead",
    "cache": "book-cache",
    "decode": {"mistake": "cache_stale", "step": 1, "layer": "transformer.attentions.0"},
    "style": "modeling_xlm.py causal: parallel ModuleLists attentions/layer_norm1/ffns/layer_norm2 (post-norm), NEW_ID layer ids, "
    "q / sqrt(d) before q.k, cache dict with slen; slip: (k, v) stored only when the layer has no entry yet",
}


class XLMConfig:
    n_words = 120
    emb_dim = 64
    n_heads = 4
    n_layers = 3
    max_position_embeddings = 64
    layer_norm_eps = 1e-12
    causal = True
    gelu_activation = True


class KVCache(dict):
    def __init__(self, n_layers=None):
        super().__init__(slen=0)


class BaseModelOutput:
    def __init__(self, logits, cache):
        self.logits = logits
        self.cache = cache


class MultiHeadAttention(nn.Module):
    NEW_ID = itertools.count()

    def __init__(self, n_heads, dim):
        super().__init__()
        self.layer_id = next(MultiHeadAttention.NEW_ID)
        self.dim = dim
        self.n_heads = n_heads
        assert self.dim % self.n_heads == 0
        self.q_lin = nn.Linear(dim, dim)
        self.k_lin = nn.Linear(dim, dim)
        self.v_lin = nn.Linear(dim, dim)
        self.out_lin = nn.Linear(dim, dim)

    def forward(self, input, mask, kv=None, cache=None):
        bs, qlen, dim = input.size()
        dim_per_head = self.dim // self.n_heads
        mask_reshape = (bs, 1, qlen, -1) if mask.dim() == 3 else (bs, 1, 1, -1)

        def shape(x):
            return x.view(bs, -1, self.n_heads, dim_per_head).transpose(1, 2)

        def unshape(x):
            return x.transpose(1, 2).contiguous().view(bs, -1, self.n_heads * dim_per_head)

        q = shape(self.q_lin(input))
        if kv is None:
            k = shape(self.k_lin(input))
            v = shape(self.v_lin(input))
        elif cache is None or self.layer_id not in cache:
            k = v = kv
            k = shape(self.k_lin(k))
            v = shape(self.v_lin(v))

        if cache is not None:
            if self.layer_id in cache:
                if kv is None:
                    k_, v_ = cache[self.layer_id]
                    k = torch.cat([k_, k], dim=2)
                    v = torch.cat([v_, v], dim=2)
                else:
                    k, v = cache[self.layer_id]
            else:
                cache[self.layer_id] = (k, v)

        q = q / math.sqrt(dim_per_head)
        scores = torch.matmul(q, k.transpose(2, 3))
        klen = scores.size(-1)  # align the mask with the keys actually held (right-aligned)
        mask = (mask == 0).view(mask_reshape)[..., -klen:].expand_as(scores)
        scores = scores.masked_fill(mask, torch.finfo(scores.dtype).min)
        weights = F.softmax(
            scores.float() if scores.dtype != torch.float64 else scores, dim=-1
        ).type_as(scores)
        context = unshape(torch.matmul(weights, v))
        return self.out_lin(context)


class TransformerFFN(nn.Module):
    def __init__(self, in_dim, dim_hidden, out_dim, config):
        super().__init__()
        self.lin1 = nn.Linear(in_dim, dim_hidden)
        self.lin2 = nn.Linear(dim_hidden, out_dim)
        self.act = F.gelu if config.gelu_activation else F.relu

    def forward(self, input):
        return self.lin2(self.act(self.lin1(input)))


def get_masks(slen, qlen, causal):
    alen = torch.arange(slen, dtype=torch.long)
    mask = torch.ones(slen, dtype=torch.bool)
    if causal:
        attn_mask = alen[None, :] <= alen[slen - qlen :, None]
    else:
        attn_mask = mask[None, :].expand(qlen, slen)
    return mask, attn_mask


class XLMModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.causal = config.causal
        self.dim = config.emb_dim
        self.n_heads = config.n_heads
        self.n_layers = config.n_layers
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, self.dim)
        self.embeddings = nn.Embedding(config.n_words, self.dim)
        self.layer_norm_emb = nn.LayerNorm(self.dim, eps=config.layer_norm_eps)
        self.attentions = nn.ModuleList()
        self.layer_norm1 = nn.ModuleList()
        self.ffns = nn.ModuleList()
        self.layer_norm2 = nn.ModuleList()
        for _ in range(self.n_layers):
            self.attentions.append(MultiHeadAttention(self.n_heads, self.dim))
            self.layer_norm1.append(nn.LayerNorm(self.dim, eps=config.layer_norm_eps))
            self.ffns.append(TransformerFFN(self.dim, 2 * self.dim, self.dim, config))
            self.layer_norm2.append(nn.LayerNorm(self.dim, eps=config.layer_norm_eps))

    def forward(self, input_ids, cache=None):
        bs, qlen = input_ids.size()
        past = cache["slen"] if cache is not None else 0
        slen = past + qlen
        mask, attn_mask = get_masks(slen, qlen, self.causal)
        attn_mask = attn_mask[None].expand(bs, qlen, slen)
        position_ids = torch.arange(past, slen, dtype=torch.long)[None].expand(bs, qlen)

        tensor = self.embeddings(input_ids)
        tensor = tensor + self.position_embeddings(position_ids).expand_as(tensor)
        tensor = self.layer_norm_emb(tensor)
        for i in range(self.n_layers):
            attn = self.attentions[i](tensor, attn_mask, cache=cache)
            tensor = tensor + attn
            tensor = self.layer_norm1[i](tensor)
            tensor = tensor + self.ffns[i](tensor)
            tensor = self.layer_norm2[i](tensor)
        if cache is not None:
            cache["slen"] += tensor.size(1)
        return tensor


class XLMPredLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.proj = nn.Linear(config.emb_dim, config.n_words, bias=True)

    def forward(self, x):
        return self.proj(x)


class XLMWithLMHeadModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.transformer = XLMModel(config)
        self.pred_layer = XLMPredLayer(config)
        self.pred_layer.proj.weight = self.transformer.embeddings.weight

    def reset_kv_cache(self):
        pass

    def forward(self, input_ids, cache=None):
        hidden = self.transformer(input_ids, cache=cache)
        return BaseModelOutput(self.pred_layer(hidden), cache)


def make_model():
    torch.manual_seed(6113)
    model = XLMWithLMHeadModel(XLMConfig())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn_like(m.weight))
                m.bias.copy_(0.1 * torch.randn_like(m.bias))
    return model.eval()

"""modelscope/dash-infer (AllSpark) LLaMA graph (python/dashinfer/allspark/model/llama_v2.py weight names,
csrc/core/operator/generate_opt/dec_opt_mqa) ported to torch.

LLaMA_v2: embedding (word_embeddings), decoder.layer.N and final (layernorm).  Each layer keeps
AllSpark's op scopes: attention_layernorm (LayerNormNoBeta, i.e. RMSNorm with gamma), attention
(`self` = the fused q|k|v Gemm without bias, GQA 4/2, `output.dense`), ffn_layernorm, ffn
(intermediate.dense, linear.dense, output.dense: SiLU-gated).  The Rotary op rotates halves with base
1e4 at the generate context's `step` positions; DecOptMQA computes q . k * 1/sqrt(d) with an additive
-1e4 causal mask in the context (prefill) phase and over the whole cache in the decoder phase, GQA
group g = h // (heads / kv_heads).
Cache: book-cache: `cache = mod.KVCache(n_layers=3)` (`get(i)`, `update(i, (k, v))`, `seq_len()`;
entries (b, s, kv, d) grown on dim 1; the cache also carries the generate context's `step`),
`model(prompt, cache=cache)`, `model(tok, cache=cache)`.  `model.reset_kv_cache()` is a no-op.
Returns the logits tensor.
Slip: DecOptMQA writes k/v into the cache only in the context phase; in the decoder phase it attends
over cache + the step's own k/v but never stores them, so step 1 no longer sees step 0's token.
Positions come from the context's step counter and are right.  Full forward and prefill are exact.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["decoder.layer.0.attention", "decoder.layer.1.attention", "decoder.layer.2.attention"],
    "kind": "causal-multihead",
    "cache": "book-cache",
    "decode": {"mistake": "cache_stale", "step": 1, "layer": "decoder.layer.0.attention"},
    "style": "dash-infer AllSpark LLaMA: decoder.layer.N.attention.self fused qkv Gemm, output.dense, LayerNormNoBeta, "
    "Rotary halves at the generate step, DecOptMQA -1e4 mask, GQA 4/2; decoder phase never stores the new k/v",
}


class KVCache:
    def __init__(self, n_layers):
        self.cache = [None] * n_layers
        self.step = 0

    def get(self, layer_idx):
        return self.cache[layer_idx]

    def update(self, layer_idx, value):
        self.cache[layer_idx] = value

    def seq_len(self):
        return 0 if self.cache[0] is None else self.cache[0][0].shape[1]

    def reset(self):
        self.cache = [None] * len(self.cache)
        self.step = 0


class LayerNormNoBeta(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.gamma


def rotary(x, positions, base=10000.0):
    # x: (b, s, n, d)
    d = x.shape[-1]
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = positions.to(torch.float64)[:, None] * inv[None]
    emb = torch.cat([ang, ang], dim=-1)
    cos, sin = emb.cos().to(x.dtype)[None, :, None], emb.sin().to(x.dtype)[None, :, None]
    half = d // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


class Dense(nn.Module):
    def __init__(self, n_in, n_out):
        super().__init__()
        self.dense = nn.Linear(n_in, n_out, bias=False)

    def forward(self, x):
        return self.dense(x)


class Attention(nn.Module):
    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_heads
        self.kv_heads = cfg.multi_query_group_num
        self.size_per_head = cfg.hidden_size // cfg.num_heads
        qkv_out = (self.num_heads + 2 * self.kv_heads) * self.size_per_head
        self.self = nn.Linear(cfg.hidden_size, qkv_out, bias=False)
        self.output = Dense(self.num_heads * self.size_per_head, cfg.hidden_size)

    def forward(self, x, positions, cache=None):
        b, s, _ = x.shape
        d = self.size_per_head
        qkv = self.self(x)
        q, k, v = qkv.split([self.num_heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1)
        q = rotary(q.view(b, s, self.num_heads, d), positions)
        k = rotary(k.view(b, s, self.kv_heads, d), positions)
        v = v.view(b, s, self.kv_heads, d)
        past = cache.get(self.layer_idx) if cache is not None else None
        if past is None:
            # context phase
            if cache is not None:
                cache.update(self.layer_idx, (k, v))
            keys, values = k, v
        else:
            # decoder phase
            keys = torch.cat([past[0], k], dim=1)
            values = torch.cat([past[1], v], dim=1)
        group = self.num_heads // self.kv_heads
        kv_index = torch.arange(self.num_heads) // group
        qh = q.transpose(1, 2)
        kh = keys[:, :, kv_index].transpose(1, 2)
        vh = values[:, :, kv_index].transpose(1, 2)
        score = torch.matmul(qh, kh.transpose(-1, -2)) * (1.0 / math.sqrt(d))
        t = kh.shape[-2]
        qpos = torch.arange(t - s, t)[:, None]
        kpos = torch.arange(t)[None, :]
        score = score + (kpos > qpos).to(score.dtype) * -1e4
        probs = F.softmax(score, dim=-1)
        ctx = torch.matmul(probs, vh).transpose(1, 2).reshape(b, s, -1)
        return self.output(ctx)


class FFN(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.intermediate = Dense(cfg.hidden_size, cfg.intermediate_size)
        self.linear = Dense(cfg.hidden_size, cfg.intermediate_size)
        self.output = Dense(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x):
        return self.output(F.silu(self.intermediate(x)) * self.linear(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg, i):
        super().__init__()
        self.attention_layernorm = LayerNormNoBeta(cfg.hidden_size, cfg.layernorm_epsilon)
        self.attention = Attention(cfg, i)
        self.ffn_layernorm = LayerNormNoBeta(cfg.hidden_size, cfg.layernorm_epsilon)
        self.ffn = FFN(cfg)

    def forward(self, x, positions, cache):
        x = x + self.attention(self.attention_layernorm(x), positions, cache)
        return x + self.ffn(self.ffn_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.layer = nn.ModuleList([DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)])


class Embedding(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)


class Final(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.layernorm = LayerNormNoBeta(cfg.hidden_size, cfg.layernorm_epsilon)


class LLaMA_v2(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embedding = Embedding(cfg)
        self.decoder = Decoder(cfg)
        self.final = Final(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def reset_kv_cache(self):
        pass

    def forward(self, input_ids, cache=None):
        b, s = input_ids.shape
        step = cache.step if cache is not None else 0
        positions = torch.arange(step, step + s)
        x = self.embedding.word_embeddings(input_ids)
        for layer in self.decoder.layer:
            x = layer(x, positions, cache)
        if cache is not None:
            cache.step = step + s
        return self.lm_head(self.final.layernorm(x))


def make_model():
    torch.manual_seed(2111)
    cfg = SimpleNamespace(
        vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_heads=4,
        multi_query_group_num=2, layernorm_epsilon=1e-5,
    )
    model = LLaMA_v2(cfg)
    g = torch.Generator().manual_seed(21111)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LayerNormNoBeta):
                m.gamma.copy_(1.0 + 0.3 * torch.randn(m.gamma.shape, generator=g))
    return model.eval()

"""intel/xFasterTransformer LlamaLLM (src/models/llama.cpp, src/layers/attention.h,
src/common/kvcache_tensor.h) ported to torch.

LlamaLLM: embedding, decoders.N (LlamaDecoder: input_norm, attn, post_norm, mlp), final_norm,
lm_head.  Attention keeps xFT's packed weights: `qkv_weight` (hidden, q + k + v) applied as
x @ W with `qkv_bias` absent, `attn_out_weight` (q, hidden); GQA 4/2 (kv head = h / (heads /
kv_heads)); LlamaRotaryEmbedding rotates halves (base 1e4) at `pastSeqLen + i`; scores *
1/sqrt(head_size) with a causal -inf mask, softmax, context, output.  The KV cache keeps
KVCacheTensor's layout: (seq, batch, kv_heads, head_size), one (k, v) pair per layer, appended on
dim 0.  The prompt (context) path computes attention on its fresh tensors; the one-token path
(`inputSeqLen == 1`, "flash decoding") reads keys/values from the cache.
Cache: hf: `out = model(prompt, use_cache=True)`, then
`model(tok, past_key_values=out.past_key_values, use_cache=True)` (tuple of per-layer (k, v),
(s, b, kv, d)); logits in `out.logits`; `model(ids)` is the full forward.
Slip: the one-token path reads the cache with `.reshape(b, kv, s, d)`, as if KVCacheTensor stored
(batch, head, seq, size); the seq-major storage is scrambled across heads and positions.
Full forward and the prompt pass are exact.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["decoders.0.attn", "decoders.1.attn", "decoders.2.attn"],
    "kind": "causal-multihead",
    "cache": "hf",
    "decode": {"mistake": "cache_other", "step": 0, "layer": "decoders.0.attn"},
    "style": "xFasterTransformer LlamaLLM: packed qkv_weight (hidden, q+k+v) as x @ W, attn_out_weight, GQA 4/2, "
    "rotate-half at pastSeqLen+i, seq-major KVCacheTensor (s, b, kv, d); one-token path reshapes the cache head-major",
}


class RmsNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class LlamaRotaryEmbedding:
    def __init__(self, dim, base=10000.0):
        self.inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))

    def forward(self, x, positions):
        # x: (b, s, n, d)
        ang = positions.to(torch.float64)[:, None] * self.inv_freq[None]
        emb = torch.cat([ang, ang], dim=-1)
        cos, sin = emb.cos().to(x.dtype)[None, :, None], emb.sin().to(x.dtype)[None, :, None]
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.respQHeads = cfg.attHeadNum
        self.respKVHeads = cfg.kvHeadNum
        self.headSize = cfg.hiddenSize // cfg.attHeadNum
        qkv_cols = (self.respQHeads + 2 * self.respKVHeads) * self.headSize
        self.qkv_weight = nn.Parameter(torch.randn(cfg.hiddenSize, qkv_cols) / math.sqrt(cfg.hiddenSize))
        self.attn_out_weight = nn.Parameter(
            torch.randn(self.respQHeads * self.headSize, cfg.hiddenSize) / math.sqrt(self.respQHeads * self.headSize)
        )
        self.rotary = LlamaRotaryEmbedding(self.headSize)

    def _attend(self, q, k, v, past_seq_len):
        # q: (b, h, s, d), k/v: (b, kv, t, d)
        group = self.respQHeads // self.respKVHeads
        idx = torch.arange(self.respQHeads) // group
        k, v = k[:, idx], v[:, idx]
        scores = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(self.headSize))
        s, t = q.shape[-2], k.shape[-2]
        qpos = torch.arange(s)[:, None] + past_seq_len
        kpos = torch.arange(t)[None, :]
        scores = scores.masked_fill(kpos > qpos, float("-inf"))
        return torch.matmul(F.softmax(scores, dim=-1), v)

    def forward(self, x, past=None):
        b, s, _ = x.shape
        d = self.headSize
        qkv = x @ self.qkv_weight
        q, k, v = qkv.split([self.respQHeads * d, self.respKVHeads * d, self.respKVHeads * d], dim=-1)
        past_seq_len = 0 if past is None else past[0].shape[0]
        positions = torch.arange(past_seq_len, past_seq_len + s)
        q = self.rotary.forward(q.view(b, s, self.respQHeads, d), positions)
        k = self.rotary.forward(k.view(b, s, self.respKVHeads, d), positions)
        v = v.view(b, s, self.respKVHeads, d)
        k_seq, v_seq = k.transpose(0, 1), v.transpose(0, 1)  # (s, b, kv, d): KVCacheTensor layout
        if past is not None:
            k_cache = torch.cat([past[0], k_seq], dim=0)
            v_cache = torch.cat([past[1], v_seq], dim=0)
        else:
            k_cache, v_cache = k_seq, v_seq
        present = (k_cache, v_cache)
        if s == 1 and past is not None:
            t = k_cache.shape[0]
            keys = k_cache.reshape(b, self.respKVHeads, t, d)
            values = v_cache.reshape(b, self.respKVHeads, t, d)
        else:
            keys = k_cache.permute(1, 2, 0, 3)
            values = v_cache.permute(1, 2, 0, 3)
        ctx = self._attend(q.transpose(1, 2), keys, values, past_seq_len)
        ctx = ctx.transpose(1, 2).reshape(b, s, -1)
        return ctx @ self.attn_out_weight, present


class LlamaMLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate_weight = nn.Parameter(torch.randn(cfg.hiddenSize, cfg.intermediateSize) / math.sqrt(cfg.hiddenSize))
        self.up_weight = nn.Parameter(torch.randn(cfg.hiddenSize, cfg.intermediateSize) / math.sqrt(cfg.hiddenSize))
        self.down_weight = nn.Parameter(torch.randn(cfg.intermediateSize, cfg.hiddenSize) / math.sqrt(cfg.intermediateSize))

    def forward(self, x):
        return (F.silu(x @ self.gate_weight) * (x @ self.up_weight)) @ self.down_weight


class LlamaDecoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.input_norm = RmsNorm(cfg.hiddenSize, cfg.epsilon)
        self.attn = Attention(cfg)
        self.post_norm = RmsNorm(cfg.hiddenSize, cfg.epsilon)
        self.mlp = LlamaMLP(cfg)

    def forward(self, x, past):
        a, present = self.attn(self.input_norm(x), past)
        x = x + a
        return x + self.mlp(self.post_norm(x)), present


class LlamaLLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embedding = nn.Embedding(cfg.vocabSize, cfg.hiddenSize)
        self.decoders = nn.ModuleList([LlamaDecoder(cfg) for _ in range(cfg.layers)])
        self.final_norm = RmsNorm(cfg.hiddenSize, cfg.epsilon)
        self.lm_head = nn.Linear(cfg.hiddenSize, cfg.vocabSize, bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        x = self.embedding(input_ids)
        presents = ()
        for i, dec in enumerate(self.decoders):
            past = past_key_values[i] if past_key_values is not None else None
            x, present = dec(x, past)
            presents += (present,)
        logits = self.lm_head(self.final_norm(x))
        return SimpleNamespace(logits=logits, past_key_values=presents if use_cache else None)


def make_model():
    torch.manual_seed(2113)
    cfg = SimpleNamespace(
        vocabSize=96, hiddenSize=64, intermediateSize=160, layers=3, attHeadNum=4, kvHeadNum=2, epsilon=1e-6,
    )
    model = LlamaLLM(cfg)
    g = torch.Generator().manual_seed(21131)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RmsNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

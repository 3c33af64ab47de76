"""mindspore-lab/mindformers research LLaMA (models/llama/llama.py, llama_transformer.py,
modules/layers.py FreqsMgr, modules/kvcache_mgr.py) ported from MindSpore to torch.

LlamaForCausalLM: model (LlamaModel: tok_embeddings, freqs_mgr, layers.N, norm_out) and lm_head.
LLamaDecodeLayer: attention_norm -> attention -> + residual, ffn_norm -> feed_forward (w1/w3 SiLU gate,
w2) -> + residual.  LLamaAttention: wq/wk/wv/wo without bias, GQA 4/2 (`_repeat_kv` via tile on a new
axis), `apply_rotary_emb` (rotate-half through the swap of the two halves, tables from FreqsMgr with
theta 1e4), `kvcache_mgr` (KVCacheMgr with `key_past`/`value_past` buffers (b, kv, seq, d),
written at `batch_valid_length - 1` on incremental steps), scores * 1/sqrt(head_dim), additive
-10000 mask from the valid length, softmax, merge, wo.  Inference keeps mindformers' switches:
`is_first_iteration` prefill, then incremental steps with `batch_valid_length` = tokens so far.
Cache: book-buffers: `model.reset_kv_cache()`, `model(prompt, use_cache=True)`, `model(tok, use_cache=True)`;
buffers hold batch <= 4 and 64 positions; `model(ids)` touches no cache.  Returns the logits tensor.
Slip: on incremental steps `FreqsMgr.increment` gathers the tables at `batch_valid_length` (the count
of valid tokens) instead of `batch_valid_length - 1`, so the new token is rotated one position ahead.
The kv cache slot and the mask use the right index.  Full forward and the prefill are exact.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["model.layers.0.attention", "model.layers.1.attention", "model.layers.2.attention"],
    "kind": "causal-multihead",
    "cache": "book-buffers",
    "decode": {"mistake": "cache_positions", "step": 0, "layer": "model.layers.0.attention"},
    "style": "mindformers LLaMA: FreqsMgr tables, KVCacheMgr key_past/value_past buffers written at "
    "batch_valid_length-1, is_first_iteration prefill, GQA 4/2 tiled, -10000 mask; increment gathers at batch_valid_length",
}


class LlamaRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class FreqsMgr(nn.Module):
    def __init__(self, head_dim, seq_length, theta=10000.0):
        super().__init__()
        freqs_base = torch.arange(0, head_dim, 2, dtype=torch.float64)[: head_dim // 2]
        freqs = 1.0 / (theta ** (freqs_base / head_dim))
        t = torch.arange(seq_length, dtype=torch.float64)
        freqs = torch.outer(t, freqs)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.freqs_cos = emb.cos()
        self.freqs_sin = emb.sin()

    def forward(self, seq_length):
        return self.freqs_cos[:seq_length], self.freqs_sin[:seq_length]

    def prefill(self, bs, seq_length):
        return self.freqs_cos[:seq_length][None].expand(bs, -1, -1), self.freqs_sin[:seq_length][None].expand(bs, -1, -1)

    def increment(self, batch_valid_length):
        idx = batch_valid_length  # should be batch_valid_length - 1
        return self.freqs_cos[idx][:, None], self.freqs_sin[idx][:, None]


def apply_rotary_emb(x, freqs_cos, freqs_sin):
    # x: (b, h, s, d); tables (b, s, d)
    cos = freqs_cos.to(x.dtype)[:, None]
    sin = freqs_sin.to(x.dtype)[:, None]
    half = x.shape[-1] // 2
    swapped = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + swapped * sin


class KVCacheMgr(nn.Module):
    def __init__(self, n_kv_head, head_dim, max_batch_size, seq_length):
        super().__init__()
        self.shape = (max_batch_size, n_kv_head, seq_length, head_dim)
        self.key_past = None
        self.value_past = None

    def reset(self, dtype):
        self.key_past = torch.zeros(self.shape, dtype=dtype)
        self.value_past = torch.zeros(self.shape, dtype=dtype)

    def forward(self, key, value, batch_valid_length, is_first_iteration):
        bs, _, seq, _ = key.shape
        if is_first_iteration:
            self.key_past[:bs, :, :seq] = key
            self.value_past[:bs, :, :seq] = value
            return key, value
        pos = int(batch_valid_length[0]) - 1
        self.key_past[:bs, :, pos : pos + 1] = key
        self.value_past[:bs, :, pos : pos + 1] = value
        return self.key_past[:bs, :, : pos + 1], self.value_past[:bs, :, : pos + 1]


class LLamaAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_head = cfg.num_heads
        self.n_kv_head = cfg.n_kv_heads
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.n_rep = self.n_head // self.n_kv_head
        self.inv_norm_factor = 1.0 / math.sqrt(self.head_dim)
        self.wq = nn.Linear(cfg.hidden_size, self.n_head * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, self.n_kv_head * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.hidden_size, self.n_kv_head * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_head * self.head_dim, cfg.hidden_size, bias=False)
        self.kvcache_mgr = KVCacheMgr(self.n_kv_head, self.head_dim, cfg.max_batch_size, cfg.seq_length)

    def _repeat_kv(self, x):
        bs, n_kv, seq, d = x.shape
        return x[:, :, None].expand(bs, n_kv, self.n_rep, seq, d).reshape(bs, n_kv * self.n_rep, seq, d)

    def forward(self, x, freqs, mask, batch_valid_length=None, is_first_iteration=True, use_past=False):
        bs, seq, _ = x.shape
        q = self.wq(x).view(bs, seq, self.n_head, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(bs, seq, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(bs, seq, self.n_kv_head, self.head_dim).transpose(1, 2)
        freqs_cos, freqs_sin = freqs
        q = apply_rotary_emb(q, freqs_cos, freqs_sin)
        k = apply_rotary_emb(k, freqs_cos, freqs_sin)
        if use_past:
            k, v = self.kvcache_mgr(k, v, batch_valid_length, is_first_iteration)
        k, v = self._repeat_kv(k), self._repeat_kv(v)
        score = torch.matmul(q, k.transpose(-1, -2)) * self.inv_norm_factor
        score = score + mask * -10000.0
        probs = F.softmax(score, dim=-1)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(bs, seq, -1)
        return self.wo(out)


class LlamaFeedForward(nn.Module):
    def __init__(self, dim, hidden_dim):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LLamaDecodeLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.attention_norm = LlamaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attention = LLamaAttention(cfg)
        self.ffn_norm = LlamaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.feed_forward = LlamaFeedForward(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, freqs, mask, **kw):
        h = x + self.attention(self.attention_norm(x), freqs, mask, **kw)
        return h + self.feed_forward(self.ffn_norm(h))


class LlamaModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.freqs_mgr = FreqsMgr(cfg.hidden_size // cfg.num_heads, cfg.seq_length + 1, cfg.theta)
        self.layers = nn.ModuleList([LLamaDecodeLayer(cfg) for _ in range(cfg.num_layers)])
        self.norm_out = LlamaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._valid_length = None

    def reset_kv_cache(self):
        dtype = self.lm_head.weight.dtype
        for layer in self.model.layers:
            layer.attention.kvcache_mgr.reset(dtype)
        self._valid_length = 0

    def forward(self, input_ids, use_cache=False):
        bs, seq = input_ids.shape
        h = self.model.tok_embeddings(input_ids)
        use_past = bool(use_cache)
        if use_past and self._valid_length is None:
            self.reset_kv_cache()
        is_first_iteration = (not use_past) or self._valid_length == 0
        if is_first_iteration:
            freqs = self.model.freqs_mgr.prefill(bs, seq)
            mask = torch.ones(seq, seq, dtype=h.dtype).triu(1)[None, None]
            batch_valid_length = torch.full((bs,), seq, dtype=torch.long)
        else:
            assert seq == 1, "incremental steps take one token"
            batch_valid_length = torch.full((bs,), self._valid_length + 1, dtype=torch.long)
            freqs = self.model.freqs_mgr.increment(batch_valid_length)
            mask = torch.zeros(1, 1, 1, self._valid_length + 1, dtype=h.dtype)
        for layer in self.model.layers:
            h = layer(h, freqs, mask, batch_valid_length=batch_valid_length,
                      is_first_iteration=is_first_iteration, use_past=use_past)
        if use_past:
            self._valid_length = int(batch_valid_length[0])
        return self.lm_head(self.model.norm_out(h))


def make_model():
    torch.manual_seed(2110)
    cfg = SimpleNamespace(
        vocab_size=96, hidden_size=64, intermediate_size=160, num_layers=3, num_heads=4, n_kv_heads=2,
        rms_norm_eps=1e-6, theta=10000.0, seq_length=64, max_batch_size=4,
    )
    model = LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(21101)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LlamaRMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

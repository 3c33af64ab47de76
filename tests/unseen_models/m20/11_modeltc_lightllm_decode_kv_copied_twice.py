"""ModelTC LightLLM llama (layer_infer / layer_weights split) without Triton kernels, in plain torch.

LightLLM keeps weights and inference apart; here `layers.N` is a TransformerLayer holding
`att_norm`, `attn` (LlamaAttention: `q_proj`, `k_proj`, `v_proj`, `o_proj`, GQA 4/2, head 16),
`ffn_norm`, `ffn`.  The inference state is an external cache object that plays LightLLM's
`mem_manager` + `req_manager`: per layer a (b, s, kv, d) key tensor and value tensor grown on dim 1
(`KVCache(n_layers)`, `get(i)`, `update(i, (k, v))`, `seq_len()`).  Rotary by halves (LightLLM's
`rotary_emb_fwd` on the first and second half), cos/sin gathered at b_seq_len - 1 for decode and at
arange for prefill, base 1e4; context / token attention = softmax(q k^T / sqrt(d)) v with the causal
range of each query.
Slip: in `_token_attention` (the one-token decode path) the new key/value are copied into the cache by
`_copy_kv_to_mem_cache` and then appended once more by the token-attention kernel's own "append"
branch, so the new token's key and value are stored twice and it attends to itself twice (prefill
uses the context path and is exact).
Cache: book-cache: `cache = mod.KVCache(n_layers=3)`, `model(prompt, cache=cache)`,
`model(tok, cache=cache)`; `model.reset_kv_cache()` is a no-op.  Returns the logits tensor.
"""

from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["layers.0.attn", "layers.1.attn", "layers.2.attn"],
    "kind": "causal-multihead",
    "cache": "book-cache",
    "decode": {
        "mistake": "cache_stale",
        "step": 0,
        "layer": "layers.0.attn",
    },
    "style": "ModelTC LightLLM llama: context vs token attention paths, mem_manager-like external KVCache (b, s, kv, d), "
    "halves rotary base 1e4, GQA 4/2; slip: decode copies the new k/v into the cache twice",
}


class KVCache:
    def __init__(self, n_layers):
        self.cache = [None] * n_layers

    def get(self, layer_idx):
        return self.cache[layer_idx]

    def update(self, layer_idx, value):
        self.cache[layer_idx] = value

    def seq_len(self):
        return 0 if self.cache[0] is None else self.cache[0][0].shape[1]

    def reset(self):
        for i in range(len(self.cache)):
            self.cache[i] = None


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary_emb_fwd(x, cos, sin):
    # x (b, t, h, d), cos/sin (t, d/2)
    half = x.shape[-1] // 2
    x0, x1 = x[..., :half], x[..., half:]
    c, s = cos[None, :, None], sin[None, :, None]
    return torch.cat([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.tp_q_head_num_, self.tp_k_head_num_ = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim_ = cfg.hidden_size // cfg.num_attention_heads
        self.q_proj = nn.Linear(cfg.hidden_size, self.tp_q_head_num_ * self.head_dim_, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.tp_k_head_num_ * self.head_dim_, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.tp_k_head_num_ * self.head_dim_, bias=False)
        self.o_proj = nn.Linear(self.tp_q_head_num_ * self.head_dim_, cfg.hidden_size, bias=False)

    def _attend(self, q, k, v, past):
        b, t = q.shape[:2]
        rep = self.tp_q_head_num_ // self.tp_k_head_num_
        k = k.repeat_interleave(rep, dim=2)
        v = v.repeat_interleave(rep, dim=2)
        att = torch.einsum("bthd,bshd->bhts", q, k) / (self.head_dim_**0.5)
        s = k.shape[1]
        qpos = past + torch.arange(t)
        att = att.masked_fill((torch.arange(s)[None, :] > qpos[:, None]).to(q.device), float("-inf"))
        return torch.einsum("bhts,bshd->bthd", att.softmax(-1), v)

    def forward(self, x, cos, sin, layer_cache):
        b, t, _ = x.shape
        q = rotary_emb_fwd(self.q_proj(x).view(b, t, -1, self.head_dim_), cos, sin)
        k = rotary_emb_fwd(self.k_proj(x).view(b, t, -1, self.head_dim_), cos, sin)
        v = self.v_proj(x).view(b, t, -1, self.head_dim_)
        past = 0 if layer_cache is None else layer_cache[0].shape[1]
        if layer_cache is None:
            ck, cv = k, v  # _context_attention: prefill
        else:
            ck = torch.cat([layer_cache[0], k], dim=1)  # _copy_kv_to_mem_cache
            cv = torch.cat([layer_cache[1], v], dim=1)
            if t == 1:  # _token_attention appends the new token again
                ck = torch.cat([ck, k], dim=1)
                cv = torch.cat([cv, v], dim=1)
        o = self._attend(q, ck, cv, ck.shape[1] - t)
        return self.o_proj(o.reshape(b, t, -1)), (ck, cv)


class TransformerLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.att_norm = RMSNorm(cfg.hidden_size)
        self.attn = LlamaAttention(cfg)
        self.ffn_norm = RMSNorm(cfg.hidden_size)
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, layer_cache):
        a, new_cache = self.attn(self.att_norm(x), cos, sin, layer_cache)
        x = x + a
        h = self.ffn_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h)), new_cache


class LlamaTpPartModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([TransformerLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def reset_kv_cache(self):
        pass

    def forward(self, input_ids, cache=None):
        t = input_ids.shape[1]
        b_start = cache.seq_len() if cache is not None else 0
        hd = self.cfg.hidden_size // self.cfg.num_attention_heads
        inv = 1.0 / (self.cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
        ang = (b_start + torch.arange(t, dtype=torch.float64))[:, None] * inv[None]
        x = self.wte(input_ids)
        cos, sin = ang.cos().to(x.dtype).to(x.device), ang.sin().to(x.dtype).to(x.device)
        for i, layer in enumerate(self.layers):
            x, new_cache = layer(x, cos, sin, cache.get(i) if cache is not None else None)
            if cache is not None:
                cache.update(i, new_cache)
        return self.lm_head(self.final_norm(x))


def make_model():
    torch.manual_seed(2011)
    cfg = SimpleNamespace(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0)
    model = LlamaTpPartModel(cfg)
    g = torch.Generator().manual_seed(20111)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

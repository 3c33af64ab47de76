"""lmdeploy PyTorch engine Llama (lmdeploy/pytorch/models/llama.py) without its Triton kernels.

LlamaForCausalLM: `model.embed_tokens`, `model.layers.N` (`input_layernorm`, `self_attn`,
`post_attention_layernorm`, `mlp` with fused `gate_up_proj` and `down_proj`), `model.norm`, `lm_head`.
LlamaAttention: one fused `qkv_proj` whose output is split by sizes (q: 4*16, k: 2*16, v: 2*16), an
`apply_rotary_pos_emb` step with rotate-half cos/sin computed from `position_ids` (base 1e4), an
`attn_fwd` step that writes the new keys/values into paged caches and reads the sequence back through a
block table, GQA 4/2 by repeat_interleave on the head axis, then `o_proj`.  The paged caches are
buffers of the model: (num_blocks, block_size 8, kv, d) per layer for k and v, each sequence of the
batch owning 8 consecutive blocks (64 positions, batch <= 4).
Cache: book-buffers: `model.reset_kv_cache()`, `model(prompt, use_cache=True)`,
`model(tok, use_cache=True)`; `model(ids)` alone touches no cache.  Returns the logits tensor.
"""

from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": ["model.layers.0.self_attn", "model.layers.1.self_attn", "model.layers.2.self_attn"],
    "kind": "causal-multihead",
    "cache": "book-buffers",
    "style": "lmdeploy pytorch engine llama.py: fused qkv_proj split by sizes, rotate-half rotary from position_ids, "
    "paged k/v cache buffers (blocks of 8) read back through a block table, GQA 4/2 repeat_interleave, "
    "fused gate_up_proj",
}

BLOCK = 8
BLOCKS_PER_SEQ = 8
MAX_BATCH = 4


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class ApplyRotaryEmb(nn.Module):
    def forward(self, q, k, cos, sin):
        # q/k (b, t, h, d); cos/sin (b, t, d)
        cos, sin = cos[:, :, None], sin[:, :, None]
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class PagedAttention(nn.Module):
    def __init__(self, num_heads, num_kv_heads, head_dim):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5

    def forward(self, q, k, v, k_cache, v_cache, block_offsets, history_len):
        b, t = q.shape[:2]
        if k_cache is not None:
            pos = history_len + torch.arange(t, device=q.device)
            blk = block_offsets[:b, pos // BLOCK]  # (b, t)
            off = (pos % BLOCK)[None].expand(b, t)
            k_cache[blk, off] = k.to(k_cache.dtype)
            v_cache[blk, off] = v.to(v_cache.dtype)
            kv_len = history_len + t
            all_pos = torch.arange(kv_len, device=q.device)
            rb = block_offsets[:b, all_pos // BLOCK]
            ro = (all_pos % BLOCK)[None].expand(b, kv_len)
            k = k_cache[rb, ro].to(q.dtype)
            v = v_cache[rb, ro].to(q.dtype)
        kv_len = k.shape[1]
        rep = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(rep, dim=2)
        v = v.repeat_interleave(rep, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * self.scale
        q_pos = (kv_len - t) + torch.arange(t, device=q.device)
        mask = torch.arange(kv_len, device=q.device)[None, :] > q_pos[:, None]
        scores = scores.masked_fill(mask, float("-inf"))
        probs = scores.softmax(-1)
        return torch.einsum("bhqk,bkhd->bqhd", probs, v)


class LlamaAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.qkv_proj = nn.Linear(cfg.hidden_size, (self.num_heads + 2 * self.num_kv_heads) * self.head_dim, bias=False)
        self.apply_rotary_pos_emb = ApplyRotaryEmb()
        self.attn_fwd = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, hidden_states, rotary_pos_emb, past_key_value, attn_metadata):
        b, t, _ = hidden_states.shape
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
                             self.num_kv_heads * self.head_dim], dim=-1)
        q = q.unflatten(-1, (self.num_heads, self.head_dim))
        k = k.unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = v.unflatten(-1, (self.num_kv_heads, self.head_dim))
        cos, sin = rotary_pos_emb
        q, k = self.apply_rotary_pos_emb(q, k, cos, sin)
        k_cache, v_cache = past_key_value if past_key_value is not None else (None, None)
        out = self.attn_fwd(q, k, v, k_cache, v_cache, attn_metadata.block_offsets, attn_metadata.history_len)
        return self.o_proj(out.reshape(b, t, -1))


class LlamaMLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, h, rotary_pos_emb, past_key_value, attn_metadata):
        h = h + self.self_attn(self.input_layernorm(h), rotary_pos_emb, past_key_value, attn_metadata)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        hd = cfg.hidden_size // cfg.num_attention_heads
        nblocks = MAX_BATCH * BLOCKS_PER_SEQ
        for i in range(cfg.num_hidden_layers):
            self.register_buffer(f"k_cache_{i}", torch.zeros(nblocks, BLOCK, cfg.num_key_value_heads, hd), persistent=False)
            self.register_buffer(f"v_cache_{i}", torch.zeros(nblocks, BLOCK, cfg.num_key_value_heads, hd), persistent=False)
        self.register_buffer("block_offsets",
                             torch.arange(nblocks).view(MAX_BATCH, BLOCKS_PER_SEQ), persistent=False)
        self.history_len = 0

    def reset_kv_cache(self):
        self.history_len = 0
        for i in range(self.cfg.num_hidden_layers):
            getattr(self, f"k_cache_{i}").zero_()
            getattr(self, f"v_cache_{i}").zero_()

    def forward(self, input_ids, use_cache=False):
        b, t = input_ids.shape
        history = self.history_len if use_cache else 0
        position_ids = (history + torch.arange(t, device=input_ids.device))[None].expand(b, t)
        hd = self.cfg.hidden_size // self.cfg.num_attention_heads
        inv_freq = 1.0 / (self.cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
        freqs = position_ids.to(torch.float64)[..., None] * inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        h = self.model.embed_tokens(input_ids)
        rot = (emb.cos().to(h.dtype), emb.sin().to(h.dtype))
        meta = SimpleNamespace(block_offsets=self.block_offsets, history_len=history)
        for i, layer in enumerate(self.model.layers):
            kv = (getattr(self, f"k_cache_{i}"), getattr(self, f"v_cache_{i}")) if use_cache else None
            h = layer(h, rot, kv, meta)
        if use_cache:
            self.history_len += t
        return self.lm_head(self.model.norm(h))


def make_model():
    torch.manual_seed(2003)
    cfg = SimpleNamespace(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0, rms_norm_eps=1e-6)
    model = LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(20031)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

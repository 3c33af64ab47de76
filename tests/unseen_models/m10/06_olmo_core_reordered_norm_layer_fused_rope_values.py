"""allenai/OLMo-core's Transformer (olmo_core/nn/transformer, attention, rope), OLMo-2 block layout.

Transformer: embeddings, blocks (nn.ModuleDict keyed "0", "1", "2"), lm_head (LMHead: norm, w_out).
ReorderedNormTransformerBlock: h = x + attention_norm(attention(x)); out = h + feed_forward_norm(
feed_forward(h)) (no pre-norm).  Attention: w_q/w_k/w_v/w_out without bias, GQA 4/2, q_norm over the
whole query projection and k_norm over the whole key projection (RMSNorm, before the head split),
RotaryEmbedding (halves, theta 5e5) applied with head_first=False on (b, s, h, d), SDPA with is_causal
and enable_gqa-style repeat.  FeedForward: w1/w2/w3 SwiGLU.
Slip: block "1" was configured with `rope.fused=True`, whose path packs q, k and v into one
(b, s, 3, kv-expanded heads, d) tensor and rotates the whole pack, so the values are rotated too.
Queries and keys are rotated correctly.
No cache.  Returns a logits tensor.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from types import SimpleNamespace

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["blocks.0.attention", "blocks.1.attention", "blocks.2.attention"],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "blocks.1.attention",
    "stage": "values",
    "mistake": "rope_on_values",
    "style": "OLMo-core: ModuleDict blocks, ReorderedNorm (post-sublayer norms), w_q/w_k/w_v/w_out, full-projection "
    "q_norm/k_norm, halves rotary theta 5e5, GQA 4/2, lm_head.norm/w_out; block 1's fused-rope path rotates the "
    "packed q/k/v including the values",
}


class RMSNorm(nn.Module):
    def __init__(self, size, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x):
        og_dtype = x.dtype
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x).to(og_dtype)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_size, theta, fused=False):
        super().__init__()
        self.dim = head_size
        self.theta = theta
        self.fused = fused

    def get_rotary_embedding(self, seq_len, device, dtype):
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.dim, 2, device=device, dtype=torch.float64) / self.dim))
        seq = torch.arange(seq_len, device=device, dtype=torch.float64)
        freqs = torch.einsum("i , j -> i j", seq, inv_freq)
        positions = torch.cat((freqs, freqs), dim=-1)
        return positions.sin().to(dtype), positions.cos().to(dtype)

    @staticmethod
    def rotate_half(x):
        B, T, nh, hs = x.size()
        x = x.view(B, T, nh, 2, hs // 2)
        x1, x2 = x.unbind(dim=-2)
        return torch.cat((-x2, x1), dim=-1)

    def apply_rotary_pos_emb(self, pos_sin, pos_cos, t):
        return (t * pos_cos) + (self.rotate_half(t) * pos_sin)

    def forward(self, q, k, head_first=False):
        T = q.shape[1]
        pos_sin, pos_cos = self.get_rotary_embedding(T, q.device, q.dtype)
        pos_sin, pos_cos = pos_sin[None, :, None, :], pos_cos[None, :, None, :]
        return self.apply_rotary_pos_emb(pos_sin, pos_cos, q), self.apply_rotary_pos_emb(pos_sin, pos_cos, k)

    def forward_fused(self, qkv):
        # qkv: (B, T, 3, nh, hs)
        B, T, three, nh, hs = qkv.shape
        pos_sin, pos_cos = self.get_rotary_embedding(T, qkv.device, qkv.dtype)
        flat = qkv.reshape(B, T, three * nh, hs)
        out = self.apply_rotary_pos_emb(pos_sin[None, :, None, :], pos_cos[None, :, None, :], flat)
        return out.view(B, T, three, nh, hs)


class Attention(nn.Module):
    def __init__(self, d_model, n_heads, n_kv_heads, rope_theta, fused_rope=False):
        super().__init__()
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = d_model // n_heads
        self.w_q = nn.Linear(d_model, n_heads * self.head_dim, bias=False)
        self.w_k = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=False)
        self.w_v = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=False)
        self.w_out = nn.Linear(n_heads * self.head_dim, d_model, bias=False)
        self.q_norm = RMSNorm(n_heads * self.head_dim)
        self.k_norm = RMSNorm(n_kv_heads * self.head_dim)
        self.rope = RotaryEmbedding(self.head_dim, rope_theta, fused=fused_rope)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.w_q(x), self.w_k(x), self.w_v(x)
        q = self.q_norm(q)
        k = self.k_norm(k)
        q = q.view(B, T, -1, self.head_dim)
        k = k.view(B, T, -1, self.head_dim)
        v = v.view(B, T, -1, self.head_dim)
        rep = self.n_heads // self.n_kv_heads
        if self.rope.fused:
            k = k.repeat_interleave(rep, dim=2)
            v = v.repeat_interleave(rep, dim=2)
            qkv = self.rope.forward_fused(torch.stack([q, k, v], dim=2))
            q, k, v = qkv.unbind(dim=2)
        else:
            q, k = self.rope(q, k, head_first=False)
            k = k.repeat_interleave(rep, dim=2)
            v = v.repeat_interleave(rep, dim=2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        att = att.transpose(1, 2).contiguous().view(B, T, -1)
        return self.w_out(att)


class FeedForward(nn.Module):
    def __init__(self, d_model, hidden_size):
        super().__init__()
        self.w1 = nn.Linear(d_model, hidden_size, bias=False)
        self.w2 = nn.Linear(hidden_size, d_model, bias=False)
        self.w3 = nn.Linear(d_model, hidden_size, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class ReorderedNormTransformerBlock(nn.Module):
    def __init__(self, cfg, block_idx):
        super().__init__()
        self.block_idx = block_idx
        self.attention = Attention(cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.rope_theta,
                                   fused_rope=block_idx in cfg.fused_rope_blocks)
        self.attention_norm = RMSNorm(cfg.d_model)
        self.feed_forward = FeedForward(cfg.d_model, cfg.hidden_size)
        self.feed_forward_norm = RMSNorm(cfg.d_model)

    def forward(self, x):
        h = x + self.attention_norm(self.attention(x))
        return h + self.feed_forward_norm(self.feed_forward(h))


class LMHead(nn.Module):
    def __init__(self, d_model, vocab_size):
        super().__init__()
        self.norm = RMSNorm(d_model)
        self.w_out = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, x):
        return self.w_out(self.norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleDict({str(i): ReorderedNormTransformerBlock(cfg, i) for i in range(cfg.n_layers)})
        self.lm_head = LMHead(cfg.d_model, cfg.vocab_size)

    def forward(self, input_ids):
        h = self.embeddings(input_ids)
        for block in self.blocks.values():
            h = block(h)
        return self.lm_head(h)


def make_model():
    torch.manual_seed(0)
    cfg = SimpleNamespace(d_model=64, n_heads=4, n_kv_heads=2, hidden_size=128, vocab_size=128, n_layers=3,
                          rope_theta=500000.0, fused_rope_blocks=(1,))
    model = Transformer(cfg)
    for m in model.modules():
        if isinstance(m, RMSNorm):
            nn.init.uniform_(m.weight, 0.6, 1.4)
    return model.eval()

"""LLaMA 3 written the way naklecha/llama3-from-scratch walks through it, packed into modules.

The notebook keeps the checkpoint's names (`layers.{i}.attention.wq.weight`, `attention_norm`,
`feed_forward.w1/w2/w3`, `ffn_norm`, `tok_embeddings`, `norm`, `output`) and computes attention one head
at a time: `q_layer = wq.view(n_heads, head_dim, dim)`, `k_layer = wk.view(n_kv_heads, head_dim, dim)`,
for each head `q_per_token = x @ q_layer_head.T`, the rotary as complex numbers
(`q_per_token.float().view(tokens, -1, 2)`, `torch.view_as_complex`, times `freqs_cis` from
`torch.polar(ones, freqs)`, rope_theta 500000: interleaved pairs), the key head shared as
`k_layer[head // 4]` (here head // (n_heads // n_kv_heads)), scores `/ head_dim ** 0.5`, a
`torch.triu(full(-inf), diagonal=1)` mask, softmax, times the value head; the heads are concatenated
and multiplied by `wo`.  Tree: tok_embeddings, layers.N (attention_norm, attention, ffn_norm,
feed_forward), norm, output.  GQA 4 query heads / 2 kv heads, 3 layers.  No cache.
Slip: layer 1's attention was ported from the notebook's multi-query aside and picks the shared
key/value head as `head % n_kv_heads` (query heads 0, 2 -> kv head 0; 1, 3 -> kv head 1) instead of
`head // (n_heads // n_kv_heads)`; layers 0 and 2 group the published way.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,  # the writer had True beside the slip it states; corrected after the first run
    "layers": [
        "layers.0.attention",
        "layers.1.attention",
        "layers.2.attention",
    ],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "layers.1.attention",
    "stage": "scores",
    "mistake": "kv_group_mapping",
    "style": "naklecha llama3-from-scratch: checkpoint names (wq/wk/wv/wo, attention_norm, ffn_norm), per-head loop "
    "over wq.view(n_heads, head_dim, dim), view_as_complex rotary with torch.polar freqs_cis (theta 5e5, "
    "interleaved), triu(-inf) mask; GQA 4/2; layer 1 shares kv heads as head % n_kv_heads",
}


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)) * self.weight


class Attention(nn.Module):
    def __init__(self, cfg, kv_mapping="grouped"):
        super().__init__()
        self.kv_mapping = kv_mapping
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.dim = cfg.dim
        self.head_dim = cfg.dim // cfg.n_heads
        self.rope_theta = cfg.rope_theta
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def kv_head_for(self, head):
        if self.kv_mapping == "modulo":
            return head % self.n_kv_heads
        return head // (self.n_heads // self.n_kv_heads)

    def freqs_cis(self, tokens, device):
        zero_to_one_split_into_64_parts = torch.arange(self.head_dim // 2, dtype=torch.float64) / (
            self.head_dim // 2
        )
        freqs = 1.0 / (self.rope_theta**zero_to_one_split_into_64_parts)
        freqs_for_each_token = torch.outer(torch.arange(tokens, dtype=torch.float64), freqs)
        return torch.polar(torch.ones_like(freqs_for_each_token), freqs_for_each_token).to(device)

    def rotate(self, per_token, freqs_cis):
        tokens = per_token.shape[-2]
        split_into_pairs = per_token.to(torch.float64).reshape(*per_token.shape[:-1], -1, 2)
        as_complex = torch.view_as_complex(split_into_pairs.contiguous())
        rotated = torch.view_as_real(as_complex * freqs_cis[:tokens])
        return rotated.reshape(per_token.shape).to(per_token.dtype)

    def forward(self, x):
        bsz, tokens, _ = x.shape
        q_layer = self.wq.weight.view(self.n_heads, self.head_dim, self.dim)
        k_layer = self.wk.weight.view(self.n_kv_heads, self.head_dim, self.dim)
        v_layer = self.wv.weight.view(self.n_kv_heads, self.head_dim, self.dim)
        freqs_cis = self.freqs_cis(tokens, x.device)
        mask = torch.full((tokens, tokens), float("-inf"), dtype=x.dtype, device=x.device)
        mask = torch.triu(mask, diagonal=1)
        qkv_attention_store = []
        for head in range(self.n_heads):
            q_layer_head = q_layer[head]
            k_layer_head = k_layer[self.kv_head_for(head)]
            v_layer_head = v_layer[self.kv_head_for(head)]
            q_per_token = torch.matmul(x, q_layer_head.T)
            k_per_token = torch.matmul(x, k_layer_head.T)
            v_per_token = torch.matmul(x, v_layer_head.T)
            q_per_token_rotated = self.rotate(q_per_token, freqs_cis)
            k_per_token_rotated = self.rotate(k_per_token, freqs_cis)
            qk_per_token = (
                torch.matmul(q_per_token_rotated, k_per_token_rotated.transpose(-2, -1))
                / (self.head_dim) ** 0.5
            )
            qk_per_token_after_masking = qk_per_token + mask
            qk_per_token_after_masking_after_softmax = F.softmax(qk_per_token_after_masking, dim=-1)
            qkv_attention = torch.matmul(qk_per_token_after_masking_after_softmax, v_per_token)
            qkv_attention_store.append(qkv_attention)
        stacked_qkv_attention = torch.cat(qkv_attention_store, dim=-1)
        return torch.matmul(stacked_qkv_attention, self.wo.weight.T)


class FeedForward(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)

    def forward(self, x):
        return torch.matmul(
            F.silu(torch.matmul(x, self.w1.weight.T)) * torch.matmul(x, self.w3.weight.T),
            self.w2.weight.T,
        )


class TransformerBlock(nn.Module):
    def __init__(self, cfg, layer_id):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg, cfg.kv_mapping_per_layer[layer_id])
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x):
        embedding_after_edit = x + self.attention(self.attention_norm(x))
        return embedding_after_edit + self.feed_forward(self.ffn_norm(embedding_after_edit))


class Llama3(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList([TransformerBlock(cfg, i) for i in range(cfg.n_layers)])
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens):
        final_embedding = self.tok_embeddings(tokens)
        for layer in self.layers:
            final_embedding = layer(final_embedding)
        return torch.matmul(self.norm(final_embedding), self.output.weight.T)


def make_model():
    torch.manual_seed(2405)
    cfg = SimpleNamespace(
        vocab_size=96,
        dim=64,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=160,
        norm_eps=1e-5,
        rope_theta=500000.0,
        kv_mapping_per_layer=["grouped", "modulo", "grouped"],
    )
    model = Llama3(cfg)
    g = torch.Generator().manual_seed(24051)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

"""The book's chapter-style KV-cache GPT with the causal mask cut from its first rows.

The cache in the layers' buffers is right, but the mask for the new tokens is always
``mask[:num_tokens_q, :num_tokens_k]``: a one-token step takes row 0, so the new token sees
the first cached key alone. Every layer is right without the cache; decoding diverges at the
first step, in the first layer, and the keys and values it holds are the full pass's.
"""

import torch
import torch.nn as nn

EXPECT = {
    "target": "make_model",
    "kind": "model",
    "ok": False,
    "decode": {"mistake": "cache_mask", "step": 0, "layer": "trf_blocks.0.att"},
}


class MultiHeadAttention(nn.Module):
    def __init__(self, d_in, d_out, context_length, num_heads):
        super().__init__()
        self.d_out, self.num_heads, self.head_dim = d_out, num_heads, d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=False)
        self.W_key = nn.Linear(d_in, d_out, bias=False)
        self.W_value = nn.Linear(d_in, d_out, bias=False)
        self.out_proj = nn.Linear(d_out, d_out)
        self.register_buffer(
            "mask", torch.triu(torch.ones(context_length, context_length), diagonal=1)
        )
        self.register_buffer("cache_k", None, persistent=False)
        self.register_buffer("cache_v", None, persistent=False)

    def forward(self, x, use_cache=False):
        b, num_tokens, _ = x.shape
        keys_new = self.W_key(x).view(b, num_tokens, self.num_heads, self.head_dim)
        values_new = self.W_value(x).view(b, num_tokens, self.num_heads, self.head_dim)
        queries = self.W_query(x).view(b, num_tokens, self.num_heads, self.head_dim)
        if use_cache:
            if self.cache_k is None:
                self.cache_k, self.cache_v = keys_new, values_new
            else:
                self.cache_k = torch.cat([self.cache_k, keys_new], dim=1)
                self.cache_v = torch.cat([self.cache_v, values_new], dim=1)
            keys, values = self.cache_k, self.cache_v
        else:
            keys, values = keys_new, values_new
        keys, values, queries = (
            keys.transpose(1, 2),
            values.transpose(1, 2),
            queries.transpose(1, 2),
        )
        attn_scores = queries @ keys.transpose(2, 3)
        num_tokens_q, num_tokens_k = queries.shape[-2], keys.shape[-2]
        mask_bool = self.mask.bool()[:num_tokens_q, :num_tokens_k]  # bug: not offset
        attn_scores.masked_fill_(mask_bool, -torch.inf)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        context = (attn_weights @ values).transpose(1, 2).reshape(b, num_tokens, self.d_out)
        return self.out_proj(context)

    def reset_cache(self):
        self.cache_k, self.cache_v = None, None


class TransformerBlock(nn.Module):
    def __init__(self, d, context_length, heads):
        super().__init__()
        self.att = MultiHeadAttention(d, d, context_length, heads)
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, use_cache=False):
        x = x + self.att(self.norm1(x), use_cache=use_cache)
        return x + self.ff(self.norm2(x))


class GPTModel(nn.Module):
    def __init__(self, vocab_size=50, emb_dim=32, context_length=32, n_heads=4, n_layers=2):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, emb_dim)
        self.pos_emb = nn.Embedding(context_length, emb_dim)
        self.trf_blocks = nn.ModuleList(
            TransformerBlock(emb_dim, context_length, n_heads) for _ in range(n_layers)
        )
        self.final_norm = nn.LayerNorm(emb_dim)
        self.out_head = nn.Linear(emb_dim, vocab_size, bias=False)
        self.current_pos = 0

    def forward(self, in_idx, use_cache=False):
        seq_len = in_idx.shape[1]
        if use_cache:
            pos_ids = torch.arange(self.current_pos, self.current_pos + seq_len)
            self.current_pos += seq_len
        else:
            pos_ids = torch.arange(0, seq_len)
        x = self.tok_emb(in_idx) + self.pos_emb(pos_ids).unsqueeze(0)
        for blk in self.trf_blocks:
            x = blk(x, use_cache=use_cache)
        return self.out_head(self.final_norm(x))

    def reset_kv_cache(self):
        for blk in self.trf_blocks:
            blk.att.reset_cache()
        self.current_pos = 0


def make_model():
    torch.manual_seed(0)
    return GPTModel()

"""The book's chapter-style KV-cache GPT: the cache lives in each attention layer's buffers.

``forward(in_idx, use_cache=False)`` and ``reset_kv_cache()``, no cache argument: the layers
append their new keys and values to ``cache_k``/``cache_v`` and count their position in
``ptr_current_pos``; the model offsets the learned position embedding by ``current_pos``.
Correct: every layer, and cached decoding equal to the full pass.
"""

import torch
import torch.nn as nn

EXPECT = {
    "target": "make_model",
    "kind": "model",
    "ok": True,
    "layers": ["trf_blocks.0.att", "trf_blocks.1.att"],
    "decode": "ok",
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
        self.ptr_current_pos = 0

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
        if use_cache:
            start = self.ptr_current_pos
            mask_bool = self.mask.bool()[start : start + num_tokens_q, :num_tokens_k]
            self.ptr_current_pos += num_tokens_q
        else:
            mask_bool = self.mask.bool()[:num_tokens_q, :num_tokens_k]
        attn_scores.masked_fill_(mask_bool, -torch.inf)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        context = (attn_weights @ values).transpose(1, 2).reshape(b, num_tokens, self.d_out)
        return self.out_proj(context)

    def reset_cache(self):
        self.cache_k, self.cache_v = None, None
        self.ptr_current_pos = 0


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

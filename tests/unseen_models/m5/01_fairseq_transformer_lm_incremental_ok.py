"""A fairseq-style TransformerLanguageModel decoder (written from memory of fairseq's
transformer_decoder.py / multihead_attention.py, in my own words): time-first (T, B, C) inside the
decoder, sinusoidal positions with fairseq's padding offset (positions start at padding_idx + 1 = 2,
the table built half sin | half cos), token embeddings scaled by sqrt(d), pre-norm layers
(decoder_normalize_before), MultiheadAttention with separate q_proj/k_proj/v_proj/out_proj (all with
bias), queries multiplied by `scaling` right after q_proj, and the fairseq (bsz * heads, T, head_dim)
bmm layout.  The future mask is an additive -inf matrix.  4 heads of 16, 3 layers.

Cache (book-cache): fairseq's `incremental_state` is a dict keyed per attention module; here it is
the `KVCache` dict defined below.  cache = mod.KVCache(n_layers=3); model.reset_kv_cache();
logits = model(prompt, cache=cache); logits = model(tok, cache=cache).  Unlike fairseq, the caller
passes only the new tokens (fairseq re-passes the whole prefix and slices the last one); the number of
tokens already seen is kept in the cache.  prev_key / prev_value are (bsz, heads, seq, head_dim).

Correct.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": [
        "decoder.layers.0.self_attn",
        "decoder.layers.1.self_attn",
        "decoder.layers.2.self_attn",
    ],
    "kind": "causal-multihead",
    "cache": "book-cache",
    "structure": {
        "heads": 4,
        "kv_heads": 4,
        "head_dim": 16,
        "causal": True,
        "cross": False,
        "rope": None,
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "fairseq TransformerDecoder LM: time-first, sinusoidal positions offset 2, embed_scale sqrt(d), "
    "q scaled after q_proj, (bsz*heads) bmm layout, incremental_state dict with prev_key/prev_value",
}


class Args:
    vocab = 160
    decoder_embed_dim = 64
    decoder_attention_heads = 4
    decoder_ffn_embed_dim = 128
    decoder_layers = 3
    padding_idx = 1
    max_target_positions = 128


class KVCache(dict):
    """fairseq incremental_state: {'<layer key>': {'prev_key': ..., 'prev_value': ...}, 'steps': int}."""

    def __init__(self, n_layers=3):
        super().__init__()
        self.n_layers = n_layers
        self["steps"] = 0

    def reset(self):
        self.clear()
        self["steps"] = 0


def sinusoidal_table(num, dim, padding_idx):
    half = dim // 2
    step = math.log(10000) / (half - 1)
    freqs = torch.exp(torch.arange(half, dtype=torch.float64) * -step)
    ang = torch.arange(num, dtype=torch.float64)[:, None] * freqs[None, :]
    table = torch.cat([torch.sin(ang), torch.cos(ang)], dim=1)
    table[padding_idx, :] = 0
    return table.float()


class SinusoidalPositionalEmbedding(nn.Module):
    def __init__(self, dim, padding_idx, num):
        super().__init__()
        self.padding_idx = padding_idx
        self.register_buffer("weights", sinusoidal_table(num, dim, padding_idx), persistent=False)

    def forward(self, bsz, seq_len, start):
        pos = self.padding_idx + 1 + start + torch.arange(seq_len)
        return self.weights.index_select(0, pos).unsqueeze(0).expand(bsz, -1, -1)


class MultiheadAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, layer_key):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim**-0.5
        self.layer_key = layer_key
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=True)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=True)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=True)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=True)

    def forward(self, query, key, value, incremental_state=None, attn_mask=None):
        tgt_len, bsz, embed_dim = query.size()
        q = self.q_proj(query) * self.scaling
        k = self.k_proj(key)
        v = self.v_proj(value)
        q = q.contiguous().view(tgt_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        k = k.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        v = v.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        if incremental_state is not None:
            saved = incremental_state.get(self.layer_key, {})
            if "prev_key" in saved:
                prev_key = saved["prev_key"].view(bsz * self.num_heads, -1, self.head_dim)
                prev_value = saved["prev_value"].view(bsz * self.num_heads, -1, self.head_dim)
                k = torch.cat([prev_key, k], dim=1)
                v = torch.cat([prev_value, v], dim=1)
            saved["prev_key"] = k.view(bsz, self.num_heads, -1, self.head_dim)
            saved["prev_value"] = v.view(bsz, self.num_heads, -1, self.head_dim)
            incremental_state[self.layer_key] = saved
        src_len = k.size(1)
        attn_weights = torch.bmm(q, k.transpose(1, 2))
        if attn_mask is not None:
            attn_weights = attn_weights + attn_mask.unsqueeze(0)
        attn_probs = F.softmax(attn_weights, dim=-1)
        attn = torch.bmm(attn_probs, v)
        assert attn.size() == (bsz * self.num_heads, tgt_len, self.head_dim)
        attn = attn.transpose(0, 1).contiguous().view(tgt_len, bsz, embed_dim)
        return self.out_proj(attn), attn_probs.view(bsz, self.num_heads, tgt_len, src_len)


class TransformerDecoderLayer(nn.Module):
    def __init__(self, args, idx):
        super().__init__()
        d = args.decoder_embed_dim
        self.self_attn = MultiheadAttention(
            d, args.decoder_attention_heads, "layers.%d.self_attn" % idx
        )
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, args.decoder_ffn_embed_dim)
        self.fc2 = nn.Linear(args.decoder_ffn_embed_dim, d)
        self.final_layer_norm = nn.LayerNorm(d)

    def forward(self, x, incremental_state, self_attn_mask):
        residual = x
        x = self.self_attn_layer_norm(x)
        x, attn = self.self_attn(x, x, x, incremental_state, self_attn_mask)
        x = residual + x
        residual = x
        x = self.final_layer_norm(x)
        x = self.fc2(F.relu(self.fc1(x)))
        return residual + x, attn


class TransformerDecoder(nn.Module):
    def __init__(self, args):
        super().__init__()
        d = args.decoder_embed_dim
        self.padding_idx = args.padding_idx
        self.embed_tokens = nn.Embedding(args.vocab, d, padding_idx=args.padding_idx)
        self.embed_scale = math.sqrt(d)
        self.embed_positions = SinusoidalPositionalEmbedding(
            d, args.padding_idx, args.max_target_positions + 2
        )
        self.layers = nn.ModuleList(
            TransformerDecoderLayer(args, i) for i in range(args.decoder_layers)
        )
        self.layer_norm = nn.LayerNorm(d)

    def buffered_future_mask(self, tgt_len, src_len, dtype):
        start = src_len - tgt_len
        full = torch.full((tgt_len, src_len), float("-inf"), dtype=dtype)
        return torch.triu(full, diagonal=start + 1)

    def forward(self, prev_output_tokens, incremental_state=None):
        bsz, tgt_len = prev_output_tokens.shape
        start = incremental_state["steps"] if incremental_state is not None else 0
        positions = self.embed_positions(bsz, tgt_len, start)
        x = self.embed_scale * self.embed_tokens(prev_output_tokens)
        x = x + positions.to(x.dtype)
        x = x.transpose(0, 1)
        mask = self.buffered_future_mask(tgt_len, start + tgt_len, x.dtype)
        for layer in self.layers:
            x, _ = layer(x, incremental_state, mask)
        x = self.layer_norm(x).transpose(0, 1)
        if incremental_state is not None:
            incremental_state["steps"] = start + tgt_len
        return F.linear(x, self.embed_tokens.weight)


class TransformerLanguageModel(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.decoder = TransformerDecoder(args)

    def reset_kv_cache(self):
        pass

    def forward(self, src_tokens, cache=None):
        return self.decoder(src_tokens, incremental_state=cache)


def make_model():
    torch.manual_seed(5101)
    model = TransformerLanguageModel(Args())
    with torch.no_grad():
        model.decoder.embed_tokens.weight.mul_(0.35)
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn_like(m.weight))
                m.bias.copy_(0.1 * torch.randn_like(m.bias))
    return model.eval()

"""fairseq2's LLaMA builder (fairseq2.models.llama + nn.transformer) in plain torch, reduced.

TransformerDecoderModel: decoder_frontend (TransformerEmbeddingFrontend: embed), decoder
(StandardTransformerDecoder: layers.N, layer_norm), final_proj.  StandardTransformerDecoderLayer is
pre-norm: self_attn_layer_norm -> self_attn -> + residual -> ffn_layer_norm -> ffn (GLUFeedForwardNetwork:
gate_proj, inner_proj, output_proj) -> + residual.  StandardMultiheadAttention: q_proj/k_proj/v_proj/
output_proj (no bias), MQA (num_key_value_heads 1), `pos_encoder` = RotaryEncoder working on complex
numbers (adjacent pairs, view_as_complex), base 1e4, padded positions by `state_bag.step_nr`,
TorchSDPA with a causal `attn_mask` (-inf above the diagonal, offset by the step).
Cache: book-cache, an IncrementalStateBag-like object `KVCache(n_layers)` (`get(i)`, `update(i, (k, v))`,
`seq_len()`), entries (b, kv, s, d) grown on dim 2: `cache = mod.KVCache(n_layers=3)`,
`model(prompt, cache=cache)`, `model(tok, cache=cache)`; `model.reset_kv_cache()` is a no-op.  Returns
logits (every position).  Correct.
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
    "style": "fairseq2 LLaMA: decoder_frontend/decoder.layers.N.self_attn/output_proj, complex RotaryEncoder "
    "(adjacent pairs) base 1e4, MQA 4/1, GLU ffn gate/inner/output_proj; external state-bag KVCache",
}


class KVCache:
    """Plays the role of fairseq2's IncrementalStateBag + per-layer FullAttentionState."""

    def __init__(self, n_layers):
        self.cache = [None] * n_layers

    def get(self, layer_idx):
        return self.cache[layer_idx]

    def update(self, layer_idx, value):
        self.cache[layer_idx] = value

    def seq_len(self):
        return 0 if self.cache[0] is None else self.cache[0][0].shape[2]

    def get_all(self):
        return self.cache

    def reset(self):
        for i in range(len(self.cache)):
            self.cache[i] = None


class RMSNorm(nn.Module):
    def __init__(self, model_dim, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(model_dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class RotaryEncoder(nn.Module):
    def __init__(self, encoding_dim, max_seq_len, theta=10000.0):
        super().__init__()
        self.encoding_dim = encoding_dim
        steps = torch.arange(max_seq_len, dtype=torch.float64)
        inv = 1.0 / (theta ** (torch.arange(0, encoding_dim, 2, dtype=torch.float64) / encoding_dim))
        angles = torch.outer(steps, inv)
        self.freqs = torch.polar(torch.ones_like(angles), angles)  # complex128, not a buffer

    def forward(self, seqs, start_step):
        # seqs: (b, s, h, d)
        seq_len = seqs.size(1)
        dtype = seqs.dtype
        complex_seqs = torch.view_as_complex(seqs.to(torch.float64).reshape(*seqs.shape[:-1], -1, 2))
        freqs = self.freqs[start_step : start_step + seq_len][None, :, None, :]
        out = torch.view_as_real(complex_seqs * freqs).flatten(-2)
        return out.to(dtype)


class StandardMultiheadAttention(nn.Module):
    def __init__(self, model_dim, num_heads, num_key_value_heads, pos_encoder, layer_idx):
        super().__init__()
        self.num_heads = num_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = model_dim // num_heads
        self.layer_idx = layer_idx
        self.q_proj = nn.Linear(model_dim, num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(model_dim, num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(model_dim, num_key_value_heads * self.head_dim, bias=False)
        self.pos_encoder = pos_encoder
        self.output_proj = nn.Linear(num_heads * self.head_dim, model_dim, bias=False)

    def forward(self, seqs, state_bag=None, start_step=0):
        b, s, _ = seqs.shape
        q = self.q_proj(seqs).unflatten(-1, (self.num_heads, self.head_dim))
        k = self.k_proj(seqs).unflatten(-1, (self.num_key_value_heads, self.head_dim))
        v = self.v_proj(seqs).unflatten(-1, (self.num_key_value_heads, self.head_dim))
        q = self.pos_encoder(q, start_step).transpose(1, 2)
        k = self.pos_encoder(k, start_step).transpose(1, 2)
        v = v.transpose(1, 2)
        if state_bag is not None:
            prev = state_bag.get(self.layer_idx)
            if prev is not None:
                k = torch.cat([prev[0], k], dim=2)
                v = torch.cat([prev[1], v], dim=2)
            state_bag.update(self.layer_idx, (k, v))
        # fairseq2 repeat_interleave on the head dim for GQA/MQA
        n_rep = self.num_heads // self.num_key_value_heads
        k = k.repeat_interleave(n_rep, dim=1)
        v = v.repeat_interleave(n_rep, dim=1)
        kv_len = k.size(2)
        mask = torch.full((s, kv_len), float("-inf"), dtype=q.dtype).triu(diagonal=start_step + 1)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        attn = attn.transpose(1, 2).flatten(2)
        return self.output_proj(attn)


class GLUFeedForwardNetwork(nn.Module):
    def __init__(self, model_dim, inner_dim):
        super().__init__()
        self.gate_proj = nn.Linear(model_dim, inner_dim, bias=False)
        self.inner_proj = nn.Linear(model_dim, inner_dim, bias=False)
        self.output_proj = nn.Linear(inner_dim, model_dim, bias=False)

    def forward(self, seqs):
        return self.output_proj(F.silu(self.gate_proj(seqs)) * self.inner_proj(seqs))


class StandardTransformerDecoderLayer(nn.Module):
    def __init__(self, model_dim, num_heads, num_kv, inner_dim, pos_encoder, layer_idx):
        super().__init__()
        self.self_attn_layer_norm = RMSNorm(model_dim)
        self.self_attn = StandardMultiheadAttention(model_dim, num_heads, num_kv, pos_encoder, layer_idx)
        self.ffn_layer_norm = RMSNorm(model_dim)
        self.ffn = GLUFeedForwardNetwork(model_dim, inner_dim)

    def forward(self, seqs, state_bag=None, start_step=0):
        seqs = seqs + self.self_attn(self.self_attn_layer_norm(seqs), state_bag, start_step)
        return seqs + self.ffn(self.ffn_layer_norm(seqs))


class StandardTransformerDecoder(nn.Module):
    def __init__(self, layers, model_dim):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.layer_norm = RMSNorm(model_dim)

    def forward(self, seqs, state_bag=None):
        start_step = state_bag.seq_len() if state_bag is not None else 0  # step_nr
        for layer in self.layers:
            seqs = layer(seqs, state_bag, start_step)
        return self.layer_norm(seqs)


class TransformerEmbeddingFrontend(nn.Module):
    def __init__(self, vocab_size, model_dim):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, model_dim)

    def forward(self, seqs):
        return self.embed(seqs)


class TransformerDecoderModel(nn.Module):
    def __init__(self, vocab_size=96, model_dim=64, num_layers=3, num_heads=4, num_kv=1, inner_dim=160):
        super().__init__()
        pos_encoder = RotaryEncoder(model_dim // num_heads, max_seq_len=128)
        self.decoder_frontend = TransformerEmbeddingFrontend(vocab_size, model_dim)
        layers = [StandardTransformerDecoderLayer(model_dim, num_heads, num_kv, inner_dim, pos_encoder, i)
                  for i in range(num_layers)]
        self.decoder = StandardTransformerDecoder(layers, model_dim)
        self.final_proj = nn.Linear(model_dim, vocab_size, bias=False)

    def reset_kv_cache(self):
        pass

    def forward(self, seqs, cache=None):
        x = self.decoder_frontend(seqs)
        x = self.decoder(x, cache)
        return self.final_proj(x)


def make_model():
    torch.manual_seed(1403)
    model = TransformerDecoderModel()
    g = torch.Generator().manual_seed(14031)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

"""A small GPT built from NVIDIA TransformerEngine building blocks (transformer_engine.pytorch), written in
plain torch with TE's module names and conventions.

Model: `embedding`, a model-level RotaryPositionEmbedding (TE returns `emb = cat([freqs, freqs])` shaped
(s, 1, 1, d): the halves layout, base 1e4), `layers.N` (blocks with separate `input_layernorm` /
`pre_mlp_layernorm` RMSNorms, `self_attention` and `mlp` with fc1 (SwiGLU, 2 x 128) / fc2), `final_layernorm`,
`output_layer`.  `self_attention` is TE's MultiheadAttention with input_layernorm=False,
attn_input_format="bshd", num_gqa_groups=2: one fused `qkv` Linear whose output is laid out
[q (4 x 16) | k (2 x 16) | v (2 x 16)], `apply_rotary_pos_emb(t, freqs, tensor_format="bshd",
interleaved=...)` on queries and keys, `core_attention` (DotProductAttention, causal,
softmax_scale 1/sqrt(16), GQA by repeat_interleave over the head axis: query head h reads kv head h // 2),
and `proj`.
Slip: layer 1 was built with `rotary_interleaved=True` (TE's flag for checkpoints whose rotary pairs are
adjacent) while the model still hands every layer the halves-layout `cat([freqs, freqs])` table, so its
queries and keys are rotated with the interleaved rotate-every-two against halves tables: not a rotation.
Layers 0 and 2 are correct.  No cache.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["layers.0.self_attention", "layers.1.self_attention", "layers.2.self_attention"],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "layers.1.self_attention",
    "stage": "rotated_queries",
    "mistake": "rope_pairing",
    "style": "TransformerEngine-style GPT: fused qkv [q|k|v] GQA 4/2 bshd, RotaryPositionEmbedding cat([f, f]) "
    "halves table, core_attention DotProductAttention causal; layer 1 built with rotary_interleaved=True "
    "applies rotate-every-two with the halves table",
}


class RotaryPositionEmbedding(nn.Module):
    def __init__(self, dim, rotary_base=10000.0):
        super().__init__()
        self.inv_freq = 1.0 / (rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))

    def forward(self, max_seq_len):
        seq = torch.arange(max_seq_len, dtype=torch.float64)
        freqs = torch.einsum("i,j->ij", seq, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.reshape(emb.size(0), 1, 1, emb.size(1))


def _rotate_half(x, interleaved):
    if not interleaved:
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1 = x[..., ::2]
    x2 = x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rotary_pos_emb(t, freqs, tensor_format="bshd", interleaved=False):
    cur_seq_len = t.shape[1] if tensor_format == "bshd" else t.shape[0]
    freqs = freqs[:cur_seq_len]
    if tensor_format == "bshd":
        freqs = freqs.transpose(0, 1)  # (1, s, 1, d)
    cos = freqs.cos().to(t.dtype)
    sin = freqs.sin().to(t.dtype)
    return t * cos + _rotate_half(t, interleaved) * sin


class DotProductAttention(nn.Module):
    def __init__(self, num_attention_heads, kv_channels, num_gqa_groups, softmax_scale=None):
        super().__init__()
        self.num_heads = num_attention_heads
        self.num_gqa_groups = num_gqa_groups
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(kv_channels)

    def forward(self, query_layer, key_layer, value_layer):
        # bshd in, bs(hd) out
        rep = self.num_heads // self.num_gqa_groups
        key_layer = key_layer.repeat_interleave(rep, dim=2)
        value_layer = value_layer.repeat_interleave(rep, dim=2)
        q, k, v = [x.transpose(1, 2) for x in (query_layer, key_layer, value_layer)]
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.softmax_scale
        s = scores.shape[-1]
        causal = torch.triu(torch.ones(s, s, dtype=torch.bool, device=scores.device), diagonal=1)
        scores = scores.masked_fill(causal, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        ctx = torch.matmul(probs, v).transpose(1, 2)
        return ctx.reshape(ctx.shape[0], ctx.shape[1], -1)


class MultiheadAttention(nn.Module):
    def __init__(self, hidden_size, num_attention_heads, num_gqa_groups, rotary_interleaved=False):
        super().__init__()
        self.hidden_size_per_attention_head = hidden_size // num_attention_heads
        self.num_attention_heads = num_attention_heads
        self.num_gqa_groups = num_gqa_groups
        self.rotary_interleaved = rotary_interleaved
        kv = self.hidden_size_per_attention_head * num_gqa_groups
        self.qkv = nn.Linear(hidden_size, hidden_size + 2 * kv, bias=False)
        self.core_attention = DotProductAttention(num_attention_heads, self.hidden_size_per_attention_head, num_gqa_groups)
        self.proj = nn.Linear(hidden_size, hidden_size, bias=False)

    def forward(self, hidden_states, rotary_pos_emb=None):
        b, s, _ = hidden_states.shape
        d = self.hidden_size_per_attention_head
        mixed = self.qkv(hidden_states)
        q_size = self.num_attention_heads * d
        kv_size = self.num_gqa_groups * d
        query_layer, key_layer, value_layer = torch.split(mixed, [q_size, kv_size, kv_size], dim=-1)
        query_layer = query_layer.reshape(b, s, self.num_attention_heads, d)
        key_layer = key_layer.reshape(b, s, self.num_gqa_groups, d)
        value_layer = value_layer.reshape(b, s, self.num_gqa_groups, d)
        if rotary_pos_emb is not None:
            query_layer = apply_rotary_pos_emb(query_layer, rotary_pos_emb, "bshd", self.rotary_interleaved)
            key_layer = apply_rotary_pos_emb(key_layer, rotary_pos_emb, "bshd", self.rotary_interleaved)
        context = self.core_attention(query_layer, key_layer, value_layer)
        return self.proj(context)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class LayerNormFreeMLP(nn.Module):
    def __init__(self, hidden_size, ffn_hidden_size):
        super().__init__()
        self.fc1 = nn.Linear(hidden_size, 2 * ffn_hidden_size, bias=False)
        self.fc2 = nn.Linear(ffn_hidden_size, hidden_size, bias=False)

    def forward(self, x):
        a, b = self.fc1(x).chunk(2, dim=-1)
        return self.fc2(F.silu(a) * b)


class TransformerLayer(nn.Module):
    def __init__(self, hidden_size, ffn_hidden_size, num_attention_heads, num_gqa_groups, rotary_interleaved=False):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size)
        self.self_attention = MultiheadAttention(hidden_size, num_attention_heads, num_gqa_groups, rotary_interleaved)
        self.pre_mlp_layernorm = RMSNorm(hidden_size)
        self.mlp = LayerNormFreeMLP(hidden_size, ffn_hidden_size)

    def forward(self, x, rotary_pos_emb):
        x = x + self.self_attention(self.input_layernorm(x), rotary_pos_emb=rotary_pos_emb)
        return x + self.mlp(self.pre_mlp_layernorm(x))


class TEGPTModel(nn.Module):
    def __init__(self, vocab_size=96, hidden_size=64, num_layers=3, heads=4, gqa_groups=2, ffn=128, max_len=64,
                 rotary_interleaved_layers=(1,)):
        super().__init__()
        self.max_len = max_len
        self.embedding = nn.Embedding(vocab_size, hidden_size)
        self.rotary_pos_emb = RotaryPositionEmbedding(hidden_size // heads)
        self.layers = nn.ModuleList(
            [TransformerLayer(hidden_size, ffn, heads, gqa_groups, rotary_interleaved=(i in rotary_interleaved_layers))
             for i in range(num_layers)]
        )
        self.final_layernorm = RMSNorm(hidden_size)
        self.output_layer = nn.Linear(hidden_size, vocab_size, bias=False)

    def forward(self, input_ids):
        x = self.embedding(input_ids)
        freqs = self.rotary_pos_emb(self.max_len).to(x.device)
        for layer in self.layers:
            x = layer(x, freqs)
        return self.output_layer(self.final_layernorm(x))


def make_model():
    torch.manual_seed(1505)
    model = TEGPTModel()
    g = torch.Generator().manual_seed(15051)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

"""A GPT built from NVIDIA TransformerEngine's PyTorch modules, in the manner of its unfused
reference path.

TEGPTModel: embedding, layers.N = TransformerLayer (self_attention + layernorm_mlp, residual
adds),
final_layernorm, output_layer; activations are sequence-first (s, b, hidden) between embedding
and head.
MultiheadAttention: `layernorm_qkv` is a LayerNormLinear (the pre-attention norm lives inside
it as
layer_norm_weight / layer_norm_bias), its output viewed (s, b, groups, heads_per_group + 2, d)
and split
[heads_per_group, 1, 1] (qkv_weight_interleaved with GQA), optional rotary (rotate_half, tables
cat(freqs, freqs) made in float64), `core_attention` = DotProductAttention (KV cache step, bool
mask from
get_full_mask with window_size = (left, right), optional ALiBi from get_alibi: -slope * |i - j|
bottom-right
aligned, standard slopes) -> UnfusedDotProductAttention (repeat_interleave of kv heads, baddbmm
with
alpha = 1/sqrt(d), + bias, masked_fill(-10000.0), softmax, bmm), then `proj`.
Cache: book-cache.  `cache = mod.KVCache(n_layers=N)` (an InferenceParams), `model(ids,
cache=cache)`;
the model calls cache.pre_step(batch, len) and each layer writes via cache.step(layer_number,
k, v).
Non-paged: per-layer (batch, 64, kv_heads, d) slabs written at [offset:offset+len].
This model: full-width rotary (halves, base 1e4), MQA 4/1, RMSNorm, no bias, no window.
Slip: DotProductAttention always uses attn_mask_type "causal" (top-left aligned) instead of
switching to
"causal_bottom_right" when inference_params is given.  Square calls (full pass, prompt) are
unaffected;
a decoded query (row 0 of a 1 x kv_len mask) sees only key 0."""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["layers.0.self_attention", "layers.1.self_attention"],
    "kind": "causal-multihead",
    "cache": "book-cache",
    "decode": {"mistake": "cache_mask", "step": 0, "layer": "layers.0.self_attention"},
    "style": "NVIDIA TransformerEngine PyTorch reference path: sequence-first sbhd activations, "
    "TransformerLayer -> self_attention (MultiheadAttention: layernorm_qkv = "
    "LayerNormLinear with fused norm, qkv_weight_interleaved per kv group [queries, key, "
    "value], core_attention = DotProductAttention -> UnfusedDotProductAttention baddbmm "
    "alpha 1/sqrt(d), masked_fill -10000.0, proj), layernorm_mlp; InferenceParams cache "
    "keyed by 1-based layer_number; rotary MQA slab cache; slip: top-left 'causal' mask "
    "kept for cached decoding",
}


class InferenceParams:
    """KV cache handed to the model as `cache=`: one entry per 1-based layer_number.

    pre_step(batch, step_len) is called by the model before each forward; `sequence_len_offset` is
    the number of positions already cached.  Paged: per-layer (total_num_pages, page_size, kv_heads,
    head_dim) pools and a (batch, max_pages) page_table filled from a free list.  Non-paged:
    per-layer (batch, max_sequence_length, kv_heads, head_dim) slabs.
    """

    def __init__(self, max_sequence_length=64, is_paged=False, page_size=4, total_num_pages=64):
        self.max_sequence_length = max_sequence_length
        self.is_paged = is_paged
        self.page_size = page_size
        self.total_num_pages = total_num_pages
        self.key_value_memory_dict = {}
        self.sequence_len_offset = 0
        self.seqlen = 0
        self.batch_size = None
        self.page_table = None
        self.free_pages = list(range(total_num_pages))

    def get_seq_length(self):
        return self.seqlen

    def pre_step(self, batch_size, step_len):
        if self.batch_size is None:
            self.batch_size = batch_size
            max_pages = -(-self.max_sequence_length // self.page_size)
            self.page_table = torch.full((batch_size, max_pages), -1, dtype=torch.long)
        if batch_size != self.batch_size:
            raise ValueError("batch size changed between steps")
        if self.seqlen + step_len > self.max_sequence_length:
            raise ValueError("sequence longer than max_sequence_length")
        self.sequence_len_offset = self.seqlen
        self.seqlen += step_len
        if self.is_paged:
            needed = -(-self.seqlen // self.page_size)
            for row in range(batch_size):
                for p in range(needed):
                    if self.page_table[row, p] < 0:
                        if not self.free_pages:
                            raise ValueError("out of KV cache pages")
                        self.page_table[row, p] = self.free_pages.pop(0)

    def _allocate(self, layer_number, k):
        _, b, heads, dim = k.shape
        if self.is_paged:
            shape = (self.total_num_pages, self.page_size, heads, dim)
        else:
            shape = (b, self.max_sequence_length, heads, dim)
        self.key_value_memory_dict[layer_number] = (
            torch.zeros(shape, dtype=k.dtype, device=k.device),
            torch.zeros(shape, dtype=k.dtype, device=k.device),
        )

    def step(self, layer_number, k, v):
        """k, v: (s, b, kv_heads, d) for the new positions; returns every cached position, sbhd."""
        if layer_number not in self.key_value_memory_dict:
            self._allocate(layer_number, k)
        k_cache, v_cache = self.key_value_memory_dict[layer_number]
        start, end = self.sequence_len_offset, self.seqlen
        if self.is_paged:
            table = self.page_table.to(k.device)
            pos = torch.arange(start, end, device=k.device)
            pages = table[:, pos // self.page_size]  # (b, s)
            slots = (pos % self.page_size).expand_as(pages)
            k_cache[pages, slots] = k.transpose(0, 1)
            v_cache[pages, slots] = v.transpose(0, 1)
            pos = torch.arange(end, device=k.device)
            pages = table[:, pos // self.page_size]
            slots = (pos % self.page_size).expand_as(pages)
            return k_cache[pages, slots].transpose(0, 1), v_cache[pages, slots].transpose(0, 1)
        k_cache[:, start:end] = k.transpose(0, 1)
        v_cache[:, start:end] = v.transpose(0, 1)
        return k_cache[:, :end].transpose(0, 1), v_cache[:, :end].transpose(0, 1)


class KVCache(InferenceParams):
    def __init__(self, n_layers, max_sequence_length=64):
        super().__init__(max_sequence_length=max_sequence_length, is_paged=False)
        self.n_layers = n_layers


class RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _norm(x, weight, bias, normalization, eps):
    if normalization == "LayerNorm":
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class LayerNormLinear(nn.Module):
    """Normalization fused in front of a Linear, TE-style parameters on one module."""

    def __init__(self, in_features, out_features, normalization, eps=1e-5):
        super().__init__()
        self.normalization = normalization
        self.eps = eps
        self.layer_norm_weight = nn.Parameter(torch.ones(in_features))
        if normalization == "LayerNorm":
            self.layer_norm_bias = nn.Parameter(torch.zeros(in_features))
        else:
            self.layer_norm_bias = None
        self.weight = nn.Parameter(torch.randn(out_features, in_features) / math.sqrt(in_features))
        self.bias = nn.Parameter(0.02 * torch.randn(out_features))

    def forward(self, x):
        ln = _norm(x, self.layer_norm_weight, self.layer_norm_bias, self.normalization, self.eps)
        return F.linear(ln, self.weight, self.bias)


class LayerNormMLP(nn.Module):
    def __init__(self, hidden_size, ffn_hidden_size, normalization, eps=1e-5):
        super().__init__()
        self.normalization = normalization
        self.eps = eps
        self.layer_norm_weight = nn.Parameter(torch.ones(hidden_size))
        if normalization == "LayerNorm":
            self.layer_norm_bias = nn.Parameter(torch.zeros(hidden_size))
        else:
            self.layer_norm_bias = None
        self.fc1_weight = nn.Parameter(
            torch.randn(ffn_hidden_size, hidden_size) / math.sqrt(hidden_size)
        )
        self.fc1_bias = nn.Parameter(torch.zeros(ffn_hidden_size))
        self.fc2_weight = nn.Parameter(
            torch.randn(hidden_size, ffn_hidden_size) / math.sqrt(ffn_hidden_size)
        )
        self.fc2_bias = nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x):
        ln = _norm(x, self.layer_norm_weight, self.layer_norm_bias, self.normalization, self.eps)
        return F.linear(
            F.gelu(F.linear(ln, self.fc1_weight, self.fc1_bias)), self.fc2_weight, self.fc2_bias
        )


class RotaryPositionEmbedding(nn.Module):
    def __init__(self, dim, rotary_base=10000.0):
        super().__init__()
        self.dim = dim
        self.rotary_base = rotary_base

    def forward(self, max_seq_len):
        inv_freq = 1.0 / (
            self.rotary_base ** (torch.arange(0, self.dim, 2, dtype=torch.float64) / self.dim)
        )
        seq = torch.arange(max_seq_len, dtype=torch.float64)
        freqs = torch.outer(seq, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.reshape(max_seq_len, 1, 1, self.dim)  # (s, 1, 1, d), sbhd


def _rotate_half(x):
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(t, freqs):
    rot_dim = freqs.shape[-1]
    t_rot, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    cos_ = torch.cos(freqs).to(t.dtype)
    sin_ = torch.sin(freqs).to(t.dtype)
    t_rot = (t_rot * cos_) + (_rotate_half(t_rot) * sin_)
    return torch.cat((t_rot, t_pass), dim=-1)


def get_alibi_slopes(num_heads):
    def power_of_2(n):
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(num_heads).is_integer():
        return power_of_2(num_heads)
    closest = 2 ** math.floor(math.log2(num_heads))
    return power_of_2(closest) + power_of_2(2 * closest)[0::2][: num_heads - closest]


def get_alibi(num_heads, max_seqlen_q, max_seqlen_kv, alibi_slopes, dtype, device):
    slopes = torch.tensor(alibi_slopes, dtype=dtype, device=device).view(1, num_heads, 1, 1)
    bias = torch.arange(max_seqlen_q, device=device).view(1, 1, max_seqlen_q, 1) - torch.arange(
        max_seqlen_kv, device=device
    ).view(1, 1, 1, max_seqlen_kv)
    bias = bias + (max_seqlen_kv - max_seqlen_q)  # bottom-right alignment
    return bias.abs().mul(-1).to(dtype) * slopes


def get_full_mask(max_seqlen_q, max_seqlen_kv, attn_mask_type, window_size, device):
    """Bool mask, True = masked out; window_size = (left, right) keys beside the diagonal."""
    q = torch.arange(max_seqlen_q, device=device).view(-1, 1)
    k = torch.arange(max_seqlen_kv, device=device).view(1, -1)
    if attn_mask_type == "causal_bottom_right":
        q = q + (max_seqlen_kv - max_seqlen_q)
    masked = k > q
    if window_size is not None and window_size[0] >= 0:
        masked = masked | (k < q - window_size[0])
    return masked.view(1, 1, max_seqlen_q, max_seqlen_kv)


class UnfusedDotProductAttention(nn.Module):
    def __init__(self, norm_factor):
        super().__init__()
        self.norm_factor = norm_factor

    def forward(self, query_layer, key_layer, value_layer, attention_mask, core_attention_bias):
        sq, b, h, d = query_layer.shape
        sk, _, ng, _ = key_layer.shape
        key_layer = key_layer.repeat_interleave(h // ng, dim=2)
        value_layer = value_layer.repeat_interleave(h // ng, dim=2)
        q = query_layer.reshape(sq, b * h, d).transpose(0, 1)
        k = key_layer.reshape(sk, b * h, d).transpose(0, 1)
        matmul_result = torch.baddbmm(
            torch.empty(b * h, sq, sk, dtype=q.dtype, device=q.device),
            q,
            k.transpose(1, 2),
            beta=0.0,
            alpha=1.0 / self.norm_factor,
        ).view(b, h, sq, sk)
        if core_attention_bias is not None:
            matmul_result = matmul_result + core_attention_bias
        matmul_result = matmul_result.masked_fill(attention_mask, -10000.0)
        probs = F.softmax(matmul_result, dim=-1)
        v = value_layer.reshape(sk, b * h, d).transpose(0, 1)
        context = torch.bmm(probs.view(b * h, sq, sk), v).view(b, h, sq, d)
        return context.permute(2, 0, 1, 3).reshape(sq, b, h * d)


class DotProductAttention(nn.Module):
    def __init__(self, config, layer_number, window_size):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.num_gqa_groups = config.num_gqa_groups
        self.kv_channels = config.hidden_size // config.num_attention_heads
        self.layer_number = layer_number
        self.window_size = window_size
        self.core_attention_bias_type = config.core_attention_bias_type
        self.alibi_slopes = (
            get_alibi_slopes(self.num_attention_heads)
            if self.core_attention_bias_type == "alibi"
            else None
        )
        self.unfused_attention = UnfusedDotProductAttention(math.sqrt(self.kv_channels))

    def forward(self, query_layer, key_layer, value_layer, inference_params=None):
        if inference_params is not None:
            key_layer, value_layer = inference_params.step(
                self.layer_number, key_layer, value_layer
            )
        attn_mask_type = "causal"
        sq, sk = query_layer.shape[0], key_layer.shape[0]
        mask = get_full_mask(sq, sk, attn_mask_type, self.window_size, query_layer.device)
        bias = None
        if self.core_attention_bias_type == "alibi":
            bias = get_alibi(
                self.num_attention_heads,
                sq,
                sk,
                self.alibi_slopes,
                query_layer.dtype,
                query_layer.device,
            )
        return self.unfused_attention(query_layer, key_layer, value_layer, mask, bias)


class MultiheadAttention(nn.Module):
    def __init__(self, config, layer_number):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_attention_heads = config.num_attention_heads
        self.num_gqa_groups = config.num_gqa_groups
        self.hidden_size_per_attention_head = config.hidden_size // config.num_attention_heads
        self.sliding_window = config.sliding_window
        self.layer_number = layer_number
        heads_per_group = self.num_attention_heads // self.num_gqa_groups
        qkv_size = self.num_gqa_groups * (heads_per_group + 2) * self.hidden_size_per_attention_head
        self.layernorm_qkv = LayerNormLinear(config.hidden_size, qkv_size, config.normalization)
        window_size = None if config.sliding_window is None else (config.sliding_window - 1, 0)

        self.core_attention = DotProductAttention(config, layer_number, window_size)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden_states, inference_params=None, rotary_pos_emb=None):
        sq, b, _ = hidden_states.shape
        ng = self.num_gqa_groups
        hpg = self.num_attention_heads // ng
        d = self.hidden_size_per_attention_head
        mixed_x_layer = self.layernorm_qkv(hidden_states)
        # qkv_weight_interleaved: per kv group [hpg queries, 1 key, 1 value]
        mixed_x_layer = mixed_x_layer.view(sq, b, ng, hpg + 2, d)
        query_layer, key_layer, value_layer = torch.split(mixed_x_layer, [hpg, 1, 1], dim=3)
        query_layer = query_layer.reshape(sq, b, ng * hpg, d)
        key_layer = key_layer.reshape(sq, b, ng, d)
        value_layer = value_layer.reshape(sq, b, ng, d)
        if rotary_pos_emb is not None:
            start = inference_params.sequence_len_offset if inference_params is not None else 0
            q_pos_emb = rotary_pos_emb[start : start + sq]
            query_layer = apply_rotary_pos_emb(query_layer, q_pos_emb)
            key_layer = apply_rotary_pos_emb(key_layer, q_pos_emb)
        context_layer = self.core_attention(
            query_layer, key_layer, value_layer, inference_params=inference_params
        )
        return self.proj(context_layer)


class TransformerLayer(nn.Module):
    def __init__(self, config, layer_number):
        super().__init__()
        self.layer_number = layer_number
        self.self_attention = MultiheadAttention(config, layer_number)
        self.layernorm_mlp = LayerNormMLP(
            config.hidden_size, config.ffn_hidden_size, config.normalization
        )

    def forward(self, hidden_states, inference_params=None, rotary_pos_emb=None):
        attention_output = self.self_attention(
            hidden_states, inference_params=inference_params, rotary_pos_emb=rotary_pos_emb
        )
        hidden_states = hidden_states + attention_output
        return hidden_states + self.layernorm_mlp(hidden_states)


class TEGPTModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embedding = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary_pos_emb = (
            RotaryPositionEmbedding(config.hidden_size // config.num_attention_heads)
            if config.position_embedding_type == "rope"
            else None
        )
        self.layers = nn.ModuleList(
            [TransformerLayer(config, i + 1) for i in range(config.num_layers)]
        )
        if config.normalization == "LayerNorm":
            self.final_layernorm = nn.LayerNorm(config.hidden_size, eps=1e-5)
        else:
            self.final_layernorm = RMSNorm(config.hidden_size)
        self.output_layer = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def reset_kv_cache(self):
        pass

    def forward(self, input_ids, cache=None):
        b, s = input_ids.shape
        hidden_states = self.embedding(input_ids).transpose(0, 1).contiguous()  # sbhd
        rotary_pos_emb = None
        if cache is not None:
            cache.pre_step(b, s)
        if self.rotary_pos_emb is not None:
            total = cache.seqlen if cache is not None else s
            rotary_pos_emb = self.rotary_pos_emb(total)
        for layer in self.layers:
            hidden_states = layer(
                hidden_states, inference_params=cache, rotary_pos_emb=rotary_pos_emb
            )
        hidden_states = self.final_layernorm(hidden_states)
        return self.output_layer(hidden_states).transpose(0, 1)


def make_model():
    torch.manual_seed(2912)
    config = SimpleNamespace(
        vocab_size=96,
        hidden_size=64,
        ffn_hidden_size=160,
        num_attention_heads=4,
        num_layers=2,
        num_gqa_groups=1,
        normalization="RMSNorm",
        core_attention_bias_type="no_bias",
        position_embedding_type="rope",
        sliding_window=None,
    )
    model = TEGPTModel(config)
    g = torch.Generator().manual_seed(29121)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layer_norm_weight") or (
                name.startswith("final_layernorm") and name.endswith("weight")
            ):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("layer_norm_bias") or name == "final_layernorm.bias":
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model.eval()

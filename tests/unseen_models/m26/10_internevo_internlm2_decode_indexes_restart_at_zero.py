"""InternEvo's InternLM2 (InternLM/InternEvo, internlm/model/modeling_internlm2.py and
internlm/model/modules/mha.py) in plain torch.  InternLM2: tok_embeddings, layers.N (InternLM2Decoder:
attention_norm, attention = GQA, ffn_norm, feed_forward w1/w3/w2), norm, output.  GQA: one packed `wqkv`
laid out (kv_heads, q_per_kv + 2, head_dim) -- q heads of a group, then its k, then its v -- and `wo`;
flash-attn style rotary (halves, positions passed as `indexes`), softmax_scale 1/sqrt(head_dim), k/v
expanded to the query heads with repeat_interleave, torch fallback of flash-attn's attention with a
bottom-right causal mask filled with -10000.0.
Cache: hf-style object.  `out = model(prompt, use_cache=True)` creates an `InferenceParams`
(key_value_memory_dict: per layer (4, 64, 2, kv_heads, head_dim), written at sequence_len_offset,
`get_seq_length()`); then `model(tok, past_key_values=out.past_key_values, use_cache=True)`.  The model
advances sequence_len_offset after each call (InternEvo's generator does this).  Logits in `out.logits`;
`model(ids)` is the full forward.
3 layers, GQA 4/2.
Slip: the model builds the rotary `indexes` as arange(seq_len) (as the packed-data path does from
cu_seqlens, where positions restart in every chunk) and never adds sequence_len_offset; the cache is still
written at the right slot.  Every decoded token's query and key are rotated for position 0.  Full forward
and the prompt pass are exact.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {'target': 'make_model',
 'ok': False,
 'layers': ['layers.0.attention', 'layers.1.attention', 'layers.2.attention'],
 'kind': 'causal-multihead',
 'cache': 'hf',
 'decode': {'mistake': 'cache_positions', 'step': 0, 'layer': 'layers.0.attention'},
 'style': 'InternEvo InternLM2: layers.N.attention GQA with packed (kv, q_per_kv+2, d) wqkv, '
          'flash-attn rotary by indexes, InferenceParams key_value_memory_dict (b, s, 2, kv, d) at '
          'sequence_len_offset; indexes = arange(seq_len) without the cache offset'}


class InferenceParams:
    """internlm.apis.inference InferenceParams: preallocated key_value_memory_dict per layer,
    (max_batch, max_seqlen, 2, kv_heads, head_dim), written at sequence_len_offset."""

    def __init__(self, max_sequence_len=64, max_batch_size=4):
        self.max_sequence_len = max_sequence_len
        self.max_batch_size = max_batch_size
        self.sequence_len_offset = 0
        self.batch_size_offset = 0
        self.key_value_memory_dict = {}

    def get_seq_length(self):
        return self.sequence_len_offset


def _update_kv_cache(kv, inference_params, layer_idx):
    """kv: (batch, seqlen, 2, kv_heads, head_dim)."""
    num_heads, head_dim = kv.shape[-2:]
    if layer_idx not in inference_params.key_value_memory_dict:
        kv_cache = torch.zeros(
            inference_params.max_batch_size, inference_params.max_sequence_len, 2, num_heads, head_dim,
            dtype=kv.dtype, device=kv.device,
        )
        inference_params.key_value_memory_dict[layer_idx] = kv_cache
    else:
        kv_cache = inference_params.key_value_memory_dict[layer_idx]
    batch_start = inference_params.batch_size_offset
    batch_end = batch_start + kv.shape[0]
    sequence_start = inference_params.sequence_len_offset
    sequence_end = sequence_start + kv.shape[1]
    kv_cache[batch_start:batch_end, sequence_start:sequence_end, ...] = kv.to(kv_cache.dtype)
    return kv_cache[batch_start:batch_end, :sequence_end, ...]


class RotaryEmbedding(nn.Module):
    """flash_attn-style rotary (interleaved=False: the two halves of each head)."""

    def __init__(self, dim, base=10000):
        super().__init__()
        self.dim = dim
        self.base = float(base)

    def _cos_sin(self, positions):
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2, dtype=torch.float64) / self.dim))
        freqs = torch.outer(positions.to(torch.float64), inv_freq)
        return torch.cos(freqs), torch.sin(freqs)

    def forward(self, x, indexes):
        """x: (b, s, h, d); indexes: (s,) absolute positions."""
        cos, sin = self._cos_sin(indexes)
        cos = cos[None, :, None, :].to(x.dtype)
        sin = sin[None, :, None, :].to(x.dtype)
        x1, x2 = x[..., : self.dim // 2], x[..., self.dim // 2 :]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def _torch_causal_attention(q, k, v, softmax_scale):
    """flash_attn.modules.mha CrossAttention fallback: q (b, sq, h, d), k/v (b, sk, h, d);
    causal mask aligned to the bottom right (the last query is the last key)."""
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    scores = torch.einsum("bthd,bshd->bhts", q, k * softmax_scale)
    row_idx = torch.arange(seqlen_q, device=q.device).view(-1, 1)
    col_idx = torch.arange(seqlen_k, device=q.device)
    causal_mask = col_idx > row_idx + seqlen_k - seqlen_q
    scores = scores.masked_fill(causal_mask, -10000.0)
    attention = torch.softmax(scores, dim=-1, dtype=v.dtype)
    return torch.einsum("bhts,bshd->bthd", attention, v)


class GQA(nn.Module):
    """internlm.model.modules.mha.GQA: packed wqkv laid out (kv_heads, q_per_kv + 2, head_dim)."""

    def __init__(self, embed_dim, num_heads, num_kv_heads, layer_idx, rope_base, kv_expand="interleave"):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.q_per_kv = num_heads // num_kv_heads
        self.head_dim = embed_dim // num_heads
        self.softmax_scale = 1 / math.sqrt(self.head_dim)
        self.kv_expand = kv_expand
        self.rotary_emb = RotaryEmbedding(self.head_dim, base=rope_base)
        self.wqkv = nn.Linear(embed_dim, embed_dim + 2 * num_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(embed_dim, embed_dim, bias=False)

    def _expand_kv(self, kv):
        # kv: (b, s, kv_heads, d) -> (b, s, heads, d)
        if self.kv_expand == "interleave":
            return kv.repeat_interleave(self.q_per_kv, dim=2)
        return kv.repeat(1, 1, self.q_per_kv, 1)

    def forward(self, x, indexes, inference_params=None):
        b, s, _ = x.shape
        qkv = self.wqkv(x)
        qkv = qkv.view(b, s, self.num_kv_heads, self.q_per_kv + 2, self.head_dim)
        q, k, v = qkv[..., : self.q_per_kv, :], qkv[..., -2, :], qkv[..., -1, :]
        q = q.reshape(b, s, self.num_heads, self.head_dim)

        q = self.rotary_emb(q, indexes)
        k = self.rotary_emb(k, indexes)

        if inference_params is not None:
            kv = torch.stack([k, v], dim=2)
            kv = _update_kv_cache(kv, inference_params, self.layer_idx)
            k, v = kv.unbind(dim=2)
        context = _torch_causal_attention(q, self._expand_kv(k), self._expand_kv(v), self.softmax_scale)
        context = context.reshape(b, s, self.num_heads * self.head_dim)
        return self.wo(context)


class FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class InternLM2Decoder(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.attention_norm = RMSNorm(config.hidden_size)
        self.attention = GQA(
            config.hidden_size, config.num_attention_heads, config.num_kv_attention_heads, layer_idx,
            config.rope_base, kv_expand=config.kv_expand[layer_idx],
        )
        self.ffn_norm = RMSNorm(config.hidden_size)
        self.feed_forward = FeedForward(config.hidden_size, config.mlp_hidden)

    def forward(self, hidden_states, indexes, inference_params=None):
        hidden_states = hidden_states + self.attention(self.attention_norm(hidden_states), indexes, inference_params)
        return hidden_states + self.feed_forward(self.ffn_norm(hidden_states))


class InternLM2(nn.Module):
    """internlm.model.modeling_internlm2.InternLM2 (tok_embeddings, layers, norm, output)."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(InternLM2Decoder(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size)
        self.output = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def reset_kv_cache(self):
        pass

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        inference_params = past_key_values
        if inference_params is None and use_cache:
            inference_params = InferenceParams(max_sequence_len=64, max_batch_size=4)
        b, s = input_ids.shape
        # positions of the packed path: restart at 0 for every call
        indexes = torch.arange(s, device=input_ids.device)
        hidden_states = self.tok_embeddings(input_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states, indexes, inference_params)
        logits = self.output(self.norm(hidden_states))
        if inference_params is not None:
            # InternEvo's generator advances the offset after every step
            inference_params.sequence_len_offset += s
        return SimpleNamespace(logits=logits, past_key_values=inference_params if use_cache else None)


def make_model():
    torch.manual_seed(2610)
    config = SimpleNamespace(
        vocab_size=96, hidden_size=64, num_layers=3, num_attention_heads=4,
        num_kv_attention_heads=2, mlp_hidden=128, rope_base=10000.0, kv_expand=["interleave"] * 3,
    )
    model = InternLM2(config)
    g = torch.Generator().manual_seed(2610 + 1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

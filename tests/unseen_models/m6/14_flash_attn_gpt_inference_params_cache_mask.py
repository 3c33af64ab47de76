"""A GPT in the shape of Dao-AILab flash-attention's `flash_attn/models/gpt.py` + `modules/mha.py`
(written from memory, in my own words, with the torch fallbacks instead of the CUDA kernels):
`GPTLMHeadModel` → `transformer` (`embeddings.word_embeddings`, `layers.N` = prenorm `Block`s that
pass (hidden_states, residual) pairs: mixer, norm1, mlp, norm2; `ln_f`) and a tied `lm_head`.
The mixer `MHA` has one `Wqkv` (with bias) rearranged "... (three h d) -> ... three h d", a
`RotaryEmbedding` (non-interleaved = halves, rotary_emb_dim 8 of head_dim 16, base 10000) applied
to q and k at `seqlen_offset`, `inner_attn` = `SelfAttention` (einsum scores with k pre-scaled by
softmax_scale, additive −10000 triu causal mask, softmax) and `inner_cross_attn` = `CrossAttention`
(causal mask aligned bottom-right), `out_proj`.  4 heads, d 64, 3 layers, vocab 130, MLP fc1/fc2
with tanh gelu.  Returns an object with `.logits`.

Cache (book-cache): `InferenceParams` (alias `KVCache`) with `key_value_memory_dict[layer_idx]` =
a zero-initialised static buffer (max_batch_size 8, max_seqlen 64, 2, heads, head_dim) and
`seqlen_offset`.  Drive: `cache = mod.KVCache(n_layers=3)`, `model(prompt, cache=cache)`, then
`model(tok, cache=cache)` (also accepted as `inference_params=`).  Unlike the library (where the
generation loop advances it), the model advances `seqlen_offset` itself after each call.  A plain
`model(tokens)` is the full forward (no cache, `inner_attn`).

Decode slip: calls with `seqlen_offset > 0` go through `_apply_rotary_update_kvcache_attention`, a
torch stand-in for `flash_attn_with_kvcache`, which writes the new k/v at `cache_seqlens` and then
attends over the *whole* static buffer without masking the unwritten (zero) slots beyond
`cache_seqlens + 1`: the new token also sees 63 − offset empty keys.  decode `cache_mask`, step 0,
`transformer.layers.0.mixer`.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": [
        "transformer.layers.0.mixer",
        "transformer.layers.1.mixer",
        "transformer.layers.2.mixer",
    ],
    "kind": "causal-multihead",
    "cache": "book-cache",
    "decode": {"mistake": "cache_mask", "step": 0, "layer": "transformer.layers.0.mixer"},
    "style": "flash_attn models/gpt.py: transformer.layers.N.mixer (MHA: Wqkv rearranged three-h-d, RotaryEmbedding halves 8/16, "
    "inner_attn/inner_cross_attn), prenorm Blocks with residual pairs, InferenceParams static kv buffers; slip: the "
    "kvcache fallback attends over every static slot",
}


class GPTConfig:
    vocab_size = 130
    n_embd = 64
    n_head = 4
    n_layer = 3
    n_inner = 128
    rotary_emb_fraction = 0.5
    rotary_emb_base = 10000.0
    layer_norm_epsilon = 1e-5
    max_batch_size = 8
    max_seqlen = 64


class InferenceParams:
    def __init__(
        self,
        n_layers=None,
        max_seqlen=GPTConfig.max_seqlen,
        max_batch_size=GPTConfig.max_batch_size,
    ):
        self.max_seqlen = max_seqlen
        self.max_batch_size = max_batch_size
        self.seqlen_offset = 0
        self.batch_size_offset = 0
        self.key_value_memory_dict = {}
        self.lengths_per_sample = None

    def reset(self, max_seqlen, max_batch_size):
        self.max_seqlen = max_seqlen
        self.max_batch_size = max_batch_size
        self.seqlen_offset = 0


KVCache = InferenceParams


class CausalLMOutput:
    def __init__(self, logits):
        self.logits = logits


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_emb_torch(x, cos, sin):
    ro_dim = cos.shape[-1] * 2
    cos = torch.cat([cos, cos], dim=-1)[:, None, :]
    sin = torch.cat([sin, sin], dim=-1)[:, None, :]
    return torch.cat(
        [x[..., :ro_dim] * cos + rotate_half(x[..., :ro_dim]) * sin, x[..., ro_dim:]], dim=-1
    )


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, base=10000.0, interleaved=False):
        super().__init__()
        self.dim = dim
        self.interleaved = interleaved
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, qkv, seqlen_offset=0):
        seqlen = qkv.shape[1]
        t = torch.arange(seqlen_offset, seqlen_offset + seqlen, dtype=torch.float64)
        freqs = torch.outer(t, self.inv_freq.double())
        cos, sin = freqs.cos().to(qkv.dtype), freqs.sin().to(qkv.dtype)
        q = apply_rotary_emb_torch(qkv[:, :, 0], cos, sin)
        k = apply_rotary_emb_torch(qkv[:, :, 1], cos, sin)
        return torch.stack([q, k, qkv[:, :, 2]], dim=2)


class SelfAttention(nn.Module):
    def __init__(self, causal=False, softmax_scale=None):
        super().__init__()
        self.causal = causal
        self.softmax_scale = softmax_scale

    def forward(self, qkv):
        batch_size, seqlen = qkv.shape[0], qkv.shape[1]
        q, k, v = qkv.unbind(dim=2)
        softmax_scale = self.softmax_scale or 1.0 / math.sqrt(q.shape[-1])
        scores = torch.einsum("bthd,bshd->bhts", q, k * softmax_scale)
        if self.causal:
            causal_mask = torch.triu(
                torch.full((seqlen, seqlen), -10000.0, device=scores.device), 1
            )
            scores = scores + causal_mask.to(dtype=scores.dtype)
        attention = torch.softmax(scores, dim=-1, dtype=v.dtype)
        return torch.einsum("bhts,bshd->bthd", attention, v)


class CrossAttention(nn.Module):
    def __init__(self, causal=False, softmax_scale=None):
        super().__init__()
        self.causal = causal
        self.softmax_scale = softmax_scale

    def forward(self, q, kv):
        batch_size, seqlen_q = q.shape[0], q.shape[1]
        seqlen_k = kv.shape[1]
        k, v = kv.unbind(dim=2)
        softmax_scale = self.softmax_scale or 1.0 / math.sqrt(q.shape[-1])
        scores = torch.einsum("bthd,bshd->bhts", q, k * softmax_scale)
        if self.causal:
            row_idx = torch.arange(seqlen_q, device=q.device)[:, None]
            col_idx = torch.arange(seqlen_k, device=kv.device)
            causal_mask = col_idx > row_idx + seqlen_k - seqlen_q
            scores = scores.masked_fill(causal_mask, -10000.0)
        attention = torch.softmax(scores, dim=-1, dtype=v.dtype)
        return torch.einsum("bhts,bshd->bthd", attention, v)


class MHA(nn.Module):
    def __init__(
        self,
        embed_dim,
        num_heads,
        layer_idx,
        rotary_emb_dim=0,
        rotary_emb_base=10000.0,
        causal=True,
    ):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.layer_idx = layer_idx
        self.head_dim = embed_dim // num_heads
        self.rotary_emb_dim = rotary_emb_dim
        if rotary_emb_dim > 0:
            self.rotary_emb = RotaryEmbedding(
                rotary_emb_dim, base=rotary_emb_base, interleaved=False
            )
        self.Wqkv = nn.Linear(embed_dim, 3 * embed_dim, bias=True)
        self.inner_attn = SelfAttention(causal=causal)
        self.inner_cross_attn = CrossAttention(causal=causal)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=True)

    def _get_kv_cache(self, inference_params, dtype):
        if (
            self.layer_idx not in inference_params.key_value_memory_dict
            or inference_params.key_value_memory_dict[self.layer_idx].dtype != dtype
        ):
            inference_params.key_value_memory_dict[self.layer_idx] = torch.zeros(
                inference_params.max_batch_size,
                inference_params.max_seqlen,
                2,
                self.num_heads,
                self.head_dim,
                dtype=dtype,
            )
        return inference_params.key_value_memory_dict[self.layer_idx]

    def _update_kv_cache(self, kv, inference_params):
        kv_cache = self._get_kv_cache(inference_params, kv.dtype)
        batch_start = inference_params.batch_size_offset
        batch_end = batch_start + kv.shape[0]
        sequence_start = inference_params.seqlen_offset
        sequence_end = sequence_start + kv.shape[1]
        kv_cache[batch_start:batch_end, sequence_start:sequence_end, ...] = kv
        return kv_cache[batch_start:batch_end, :sequence_end, ...]

    def _apply_rotary_update_kvcache_attention(self, q, kv, inference_params):
        # torch stand-in for flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=...)
        kv_cache = self._get_kv_cache(inference_params, kv.dtype)
        batch = q.shape[0]
        cache_seqlens = inference_params.seqlen_offset
        kv_cache[:batch, cache_seqlens : cache_seqlens + kv.shape[1]] = kv
        k_cache, v_cache = kv_cache[:batch].unbind(dim=2)
        scores = torch.einsum("bthd,bshd->bhts", q, k_cache / math.sqrt(self.head_dim))
        attention = torch.softmax(scores, dim=-1, dtype=v_cache.dtype)
        return torch.einsum("bhts,bshd->bthd", attention, v_cache)

    def forward(self, x, inference_params=None):
        qkv = self.Wqkv(x)
        b, s, _ = qkv.shape
        qkv = qkv.view(b, s, 3, self.num_heads, self.head_dim)
        seqlen_offset = 0 if inference_params is None else inference_params.seqlen_offset
        if self.rotary_emb_dim > 0:
            qkv = self.rotary_emb(qkv, seqlen_offset=seqlen_offset)
        if inference_params is None:
            context = self.inner_attn(qkv)
        elif inference_params.seqlen_offset == 0:
            kv = self._update_kv_cache(qkv[:, :, 1:], inference_params)
            context = self.inner_cross_attn(qkv[:, :, 0], kv)
        else:
            context = self._apply_rotary_update_kvcache_attention(
                qkv[:, :, 0], qkv[:, :, 1:], inference_params
            )
        return self.out_proj(context.reshape(b, s, -1))


class Mlp(nn.Module):
    def __init__(self, in_features, hidden_features):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.fc2 = nn.Linear(hidden_features, in_features)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        rotary_dim = int(config.rotary_emb_fraction * (config.n_embd // config.n_head))
        self.mixer = MHA(
            config.n_embd,
            config.n_head,
            layer_idx,
            rotary_emb_dim=rotary_dim,
            rotary_emb_base=config.rotary_emb_base,
        )
        self.dropout1 = nn.Dropout(0.0)
        self.norm1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = Mlp(config.n_embd, config.n_inner)
        self.dropout2 = nn.Dropout(0.0)
        self.norm2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)

    def forward(self, hidden_states, residual=None, inference_params=None):
        dropped = self.dropout1(hidden_states)
        residual = (dropped + residual) if residual is not None else dropped
        hidden_states = self.norm1(residual)
        hidden_states = self.mixer(hidden_states, inference_params=inference_params)
        dropped = self.dropout2(hidden_states)
        residual = dropped + residual
        hidden_states = self.norm2(residual)
        return self.mlp(hidden_states), residual


class GPT2Embeddings(nn.Module):
    def __init__(self, embed_dim, vocab_size):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab_size, embed_dim)

    def forward(self, input_ids):
        return self.word_embeddings(input_ids)


class GPTModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embeddings = GPT2Embeddings(config.n_embd, config.vocab_size)
        self.layers = nn.ModuleList([Block(config, i) for i in range(config.n_layer)])
        self.drop_f = nn.Dropout(0.0)
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)

    def forward(self, input_ids, inference_params=None):
        hidden_states = self.embeddings(input_ids)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(
                hidden_states, residual, inference_params=inference_params
            )
        residual = self.drop_f(hidden_states) + residual
        return self.ln_f(residual)


class GPTLMHeadModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.transformer = GPTModel(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.embeddings.word_embeddings.weight

    def reset_kv_cache(self):
        pass

    def forward(self, input_ids, inference_params=None, cache=None):
        inference_params = cache if cache is not None else inference_params
        hidden_states = self.transformer(input_ids, inference_params=inference_params)
        if inference_params is not None:
            inference_params.seqlen_offset += input_ids.shape[1]
        return CausalLMOutput(self.lm_head(hidden_states))


def make_model():
    torch.manual_seed(6114)
    model = GPTLMHeadModel(GPTConfig())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn_like(m.weight))
                m.bias.copy_(0.1 * torch.randn_like(m.bias))
            if isinstance(m, nn.Linear) and m.bias is not None:
                m.bias.copy_(0.05 * torch.randn_like(m.bias))
    return model.eval()

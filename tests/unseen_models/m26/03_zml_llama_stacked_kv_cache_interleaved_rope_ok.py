"""zml's Llama example (zml/zml, examples/llama/llama.zig) ported from Zig to torch.  LlamaLM: model
(Llama: embed_tokens, layers.N, norm) and lm_head; TransformerLayer: input_layernorm, self_attn (SelfAttn:
q_proj, k_proj, v_proj, o_proj with {dout, d} weights), post_attention_layernorm, mlp (up/gate/down).
zml.nn.rope with the `.interleaved` layout (hf_rope_impl false: pairs (x[2i], x[2i+1])), pos_index =
arange(s) + token_index; zml.nn.causalAttnMask over all max_seq_len slots (0 / dtype minimum) with rows
gathered at token_index; zml.nn.sdpa splits the query heads as (kv_heads, heads / kv_heads) and scales
by 1/sqrt(head_dim).  KvCache: k and v stacked over layers {layer, b, k = 64, h, hd} plus layer_index
(`at_layer(i)`), `update(k, v, token_index)` returning updated stacked tensors (dynamicUpdateSlice).
Cache: book-buffers.  `model.reset_kv_cache()`, `model(prompt, use_cache=True)`, then
`model(tok, use_cache=True)`; the model keeps token_index.  Batch <= 4 is not a limit here (the stacked
cache is sized from the prompt batch), 64 positions.  `model(ids)` touches no cache.  Returns logits.
Correct: 3 layers, GQA 4/2, rope_theta 10000.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {'target': 'make_model',
 'ok': True,
 'layers': ['model.layers.0.self_attn', 'model.layers.1.self_attn', 'model.layers.2.self_attn'],
 'kind': 'causal-multihead',
 'cache': 'book-buffers',
 'style': 'zml examples/llama ported: model.layers.N.self_attn, interleaved zml.nn.rope at '
          'arange+token_index, causalAttnMask over all slots gathered at token_index, sdpa (hkv, '
          'hq) head split, layer-stacked KvCache with layer_index'}


def rope(x, pos_index, freq_base, layout):
    """zml.nn.rope: x (b, s, h, hd), pos_index (s,).  layout "interleaved" pairs (x[2i], x[2i+1]),
    "sequential" pairs (x[i], x[i + hd/2]) (the HF checkpoints)."""
    hd = x.shape[-1]
    inv_freq = 1.0 / (freq_base ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    angles = pos_index.to(torch.float64)[:, None] * inv_freq[None, :]
    cos = torch.cos(angles)[None, :, None, :].to(x.dtype)
    sin = torch.sin(angles)[None, :, None, :].to(x.dtype)
    if layout == "interleaved":
        real, imag = x[..., 0::2], x[..., 1::2]
        return torch.stack([real * cos - imag * sin, real * sin + imag * cos], dim=-1).flatten(-2)
    real, imag = x[..., : hd // 2], x[..., hd // 2 :]
    return torch.cat([real * cos - imag * sin, real * sin + imag * cos], dim=-1)


def causal_attn_mask(q, k, dtype, device):
    """zml.nn.causalAttnMask: 0 where key <= query, dtype minimum above the diagonal."""
    mask = torch.zeros(q, k, dtype=dtype, device=device)
    upper = torch.ones(q, k, dtype=torch.bool, device=device).triu(1)
    return mask.masked_fill(upper, torch.finfo(dtype).min)


def sdpa(q, k, v, attn_mask):
    """zml.nn.sdpa: q (b, q, h, hd), k/v (b, k, hkv, hd); heads split as (hkv, hq/hkv)."""
    b, sq, h, hd = q.shape
    hkv = k.shape[2]
    q = q.reshape(b, sq, hkv, h // hkv, hd)
    scores = torch.einsum("bqgrd,bkgd->bgrqk", q, k) * (1.0 / math.sqrt(hd))
    scores = scores + attn_mask
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bgrqk,bkgd->bqgrd", probs, v)
    return out.reshape(b, sq, h, hd)


class KvCache(nn.Module):
    """zml KvCache: k and v stacked over layers, {layer, b, k, h, hd}, plus layer_index."""

    def __init__(self, num_layers, max_seq_len, num_kv_heads, head_dim):
        super().__init__()
        self.shape = (num_layers, 0, max_seq_len, num_kv_heads, head_dim)
        self.register_buffer("k", torch.zeros(self.shape), persistent=False)
        self.register_buffer("v", torch.zeros(self.shape), persistent=False)
        self.layer_index = 0

    def reset(self, batch, dtype, device):
        shape = (self.shape[0], batch, *self.shape[2:])
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def at_layer(self, i):
        self.layer_index = i
        return self

    def keys(self):
        return self.k[self.layer_index]

    def values(self):
        return self.v[self.layer_index]

    def update(self, new_k, new_v, token_index):
        """dynamicUpdateSlice at {layer = layer_index, k = token_index}; returns new stacked tensors."""
        s = new_k.shape[1]
        k = self.k.clone()
        v = self.v.clone()
        k[self.layer_index, :, token_index : token_index + s] = new_k.to(k.dtype)
        v[self.layer_index, :, token_index : token_index + s] = new_v.to(v.dtype)
        return k, v


class Linear(nn.Module):
    """zml.nn.Linear with a {dout, d} weight."""

    def __init__(self, d, dout, bias=False):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dout, d) / math.sqrt(d))
        self.bias = nn.Parameter(torch.zeros(dout)) if bias else None

    def forward(self, x):
        y = x @ self.weight.t()
        return y + self.bias if self.bias is not None else y


class RmsNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.to(x.dtype)


class SelfAttn(nn.Module):
    def __init__(self, config, layer_names):
        super().__init__()
        d, h, hkv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        hd = d // h
        self.q_proj = Linear(d, h * hd)
        self.k_proj = Linear(d, hkv * hd)
        self.v_proj = Linear(d, hkv * hd)
        self.o_proj = Linear(h * hd, d)
        self.num_heads = h
        self.num_kv_heads = hkv
        self.head_dim = hd
        self.rope_opts = SimpleNamespace(
            layout="sequential" if config.hf_rope_impl else "interleaved", freq_base=config.rope_theta
        )
        # tensor-store names of this layer's projections
        self.names = layer_names

    def forward(self, x, token_index, kv_cache=None):
        b, s, _ = x.shape
        q = getattr(self, self.names["q"])(x).view(b, s, self.num_heads, self.head_dim)
        k = getattr(self, self.names["k"])(x).view(b, s, self.num_kv_heads, self.head_dim)
        v = getattr(self, self.names["v"])(x).view(b, s, self.num_kv_heads, self.head_dim)

        pos_index = torch.arange(s, device=x.device) + token_index
        q = rope(q, pos_index, self.rope_opts.freq_base, self.rope_opts.layout)
        k = rope(k, pos_index, self.rope_opts.freq_base, self.rope_opts.layout)

        if kv_cache is None:
            attn_mask = causal_attn_mask(s, s, x.dtype, x.device)
            new_kv = None
        else:
            # mask over every slot of the cache, rows gathered at token_index
            seq_len = kv_cache.k.shape[2]
            attn_mask = causal_attn_mask(seq_len, seq_len, x.dtype, x.device)
            attn_mask = attn_mask[token_index : token_index + s]
            new_kv = kv_cache.update(k, v, token_index)
            k = new_kv[0][kv_cache.layer_index].to(q.dtype)
            v = new_kv[1][kv_cache.layer_index].to(q.dtype)
        attn_output = sdpa(q, k, v, attn_mask)
        attn = attn_output.reshape(b, s, self.num_heads * self.head_dim)
        return self.o_proj(attn), new_kv


class Mlp(nn.Module):
    def __init__(self, d, hidden):
        super().__init__()
        self.up_proj = Linear(d, hidden)
        self.gate_proj = Linear(d, hidden)
        self.down_proj = Linear(hidden, d)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TransformerLayer(nn.Module):
    def __init__(self, config, layer_names):
        super().__init__()
        self.input_layernorm = RmsNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = SelfAttn(config, layer_names)
        self.post_attention_layernorm = RmsNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = Mlp(config.hidden_size, config.intermediate_size)

    def forward(self, x0, token_index, kv_cache=None):
        delta0, updated_kv = self.self_attn(self.input_layernorm(x0), token_index, kv_cache)
        x1 = x0 + delta0
        x2 = self.mlp(self.post_attention_layernorm(x1)) + x1
        return x2, updated_kv


class Llama(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            TransformerLayer(config, config.layer_names(i)) for i in range(config.num_hidden_layers)
        )
        self.norm = RmsNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, tokens, token_index, kv_cache=None):
        hidden = self.embed_tokens(tokens)
        for i, layer in enumerate(self.layers):
            if kv_cache is None:
                hidden, _ = layer(hidden, token_index, None)
                continue
            hidden, updated = layer(hidden, token_index, kv_cache.at_layer(i))
            kv_cache.k, kv_cache.v = updated
        return self.norm(hidden)


class LlamaLM(nn.Module):
    """examples/llama LlamaLM: model (Llama) + lm_head; token_index and kv_cache held here."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = Llama(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        hd = config.hidden_size // config.num_attention_heads
        self.kv_cache = KvCache(config.num_hidden_layers, config.max_seq_len, config.num_key_value_heads, hd)
        self.token_index = 0

    def reset_kv_cache(self):
        self.kv_cache.reset(0, self.lm_head.weight.dtype, self.lm_head.weight.device)
        self.token_index = 0

    def forward(self, tokens, use_cache=False):
        if not use_cache:
            return self.lm_head(self.model(tokens, 0, None))
        if self.kv_cache.k.shape[1] != tokens.shape[0] or self.token_index == 0:
            self.kv_cache.reset(tokens.shape[0], self.lm_head.weight.dtype, tokens.device)
        out = self.model(tokens, self.token_index, self.kv_cache)
        self.token_index += tokens.shape[1]
        return self.lm_head(out)


def make_model():
    torch.manual_seed(2603)
    n_layers = 3

    def layer_names(i):
        return {"q": "q_proj", "k": "k_proj", "v": "v_proj"}

    config = SimpleNamespace(
        vocab_size=96, hidden_size=64, num_hidden_layers=n_layers, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, rms_norm_eps=1e-5, rope_theta=10000.0,
        hf_rope_impl=False, max_seq_len=64, layer_names=layer_names,
    )
    model = LlamaLM(config)
    g = torch.Generator().manual_seed(2603 + 1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RmsNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

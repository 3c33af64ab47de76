"""state-spaces/mamba `mamba_ssm` MHA mixer (mamba_ssm/modules/mha.py) in an attention-only
MixerModel (mamba_ssm/models/mixer_seq_simple.py, attn_layer_idx = every layer), reduced.

MambaLMHeadModel: backbone (MixerModel: embedding, layers.N, norm_f) and lm_head.  Block (mamba_ssm
modules/block.py): norm -> mixer -> (residual kept separately, added before the next norm) -> norm2 ->
mlp (GatedMLP: fc1 to 2 x hidden, chunk, y * silu(gate), fc2).  MHA: one fused `in_proj` (q | k | v,
with bias), `out_proj`, num_heads 4, num_heads_kv 2 (GQA, repeat_interleave), partial rotary
rotary_emb_dim 8 of head_dim 16 (non-interleaved halves, base 1e4, at seqlen_offset), softmax scale
1/sqrt(head_dim), causal.  Without flash-attn the mixer falls back to
`F.scaled_dot_product_attention(..., is_causal=self.causal)`.
Cache: book-cache; `KVCache(n_layers)` plays InferenceParams.key_value_memory_dict (`get(i)`,
`update(i, (k, v))`, `seq_len()`), entries (b, s, kv, d) grown on dim 1: `cache = mod.KVCache(n_layers=3)`,
`model(prompt, cache=cache)`, `model(tok, cache=cache)`; `model.reset_kv_cache()` is a no-op.  Returns
logits.
Slip: on one-token steps the SDPA fallback (standing in for flash_attn_with_kvcache, which aligns the
causal mask bottom-right) still passes `is_causal=True`; SDPA's causal mask is top-left, so the new
token's single query row sees only key 0.  Full forward and prompt pass are exact.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": [
        "backbone.layers.0.mixer",
        "backbone.layers.1.mixer",
        "backbone.layers.2.mixer",
    ],
    "kind": "causal-multihead",
    "cache": "book-cache",
    "decode": {
        "mistake": "cache_mask",
        "step": 0,
        "layer": "backbone.layers.0.mixer",
    },
    "style": "mamba_ssm MHA mixer in an attention-only MixerModel: fused in_proj with bias, GQA 4/2, partial rotary 8/16 "
    "at seqlen_offset, Block with separate residual, GatedMLP; slip: decode SDPA with is_causal=True (top-left)",
}


class KVCache:
    def __init__(self, n_layers):
        self.cache = [None] * n_layers

    def get(self, layer_idx):
        return self.cache[layer_idx]

    def update(self, layer_idx, value):
        self.cache[layer_idx] = value

    def seq_len(self):
        return 0 if self.cache[0] is None else self.cache[0][0].shape[1]

    def get_all(self):
        return self.cache

    def reset(self):
        for i in range(len(self.cache)):
            self.cache[i] = None


class RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, base=10000.0):
        super().__init__()
        self.dim = dim
        self.inv_freq64 = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))

    def _apply_rotary(self, x, cos, sin):
        rd = cos.shape[-1] * 2
        x_rot, x_pass = x[..., :rd], x[..., rd:]
        x1, x2 = x_rot.chunk(2, dim=-1)
        cos2 = torch.cat([cos, cos], -1)
        sin2 = torch.cat([sin, sin], -1)
        rotated = x_rot * cos2 + torch.cat([-x2, x1], -1) * sin2
        return torch.cat([rotated, x_pass], dim=-1)

    def forward(self, q, k, seqlen_offset=0):
        # q, k: (b, s, h, d)
        s = q.shape[1]
        t = torch.arange(seqlen_offset, seqlen_offset + s, dtype=torch.float64)
        freqs = torch.outer(t, self.inv_freq64)
        cos = freqs.cos().to(q.dtype)[None, :, None, :]
        sin = freqs.sin().to(q.dtype)[None, :, None, :]
        return self._apply_rotary(q, cos, sin), self._apply_rotary(k, cos, sin)


class MHA(nn.Module):
    def __init__(self, embed_dim, num_heads, num_heads_kv, rotary_emb_dim, layer_idx, causal=True):
        super().__init__()
        self.embed_dim = embed_dim
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_heads_kv = num_heads_kv
        self.head_dim = embed_dim // num_heads
        self.causal = causal
        self.softmax_scale = None
        qkv_dim = self.head_dim * (self.num_heads + 2 * self.num_heads_kv)
        self.rotary_emb_dim = rotary_emb_dim
        self.rotary_emb = RotaryEmbedding(rotary_emb_dim)
        self.in_proj = nn.Linear(embed_dim, qkv_dim, bias=True)
        self.out_proj = nn.Linear(self.head_dim * self.num_heads, embed_dim, bias=True)

    def _update_kv_cache(self, kv, inference_params):
        prev = inference_params.get(self.layer_idx)
        if prev is not None:
            kv = (torch.cat([prev[0], kv[0]], dim=1), torch.cat([prev[1], kv[1]], dim=1))
        inference_params.update(self.layer_idx, kv)
        return kv

    def forward(self, x, inference_params=None, seqlen_offset=0):
        b, s, _ = x.shape
        qkv = self.in_proj(x)
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_heads_kv * self.head_dim
        q = qkv[..., :q_size].view(b, s, self.num_heads, self.head_dim)
        k = qkv[..., q_size : q_size + kv_size].view(b, s, self.num_heads_kv, self.head_dim)
        v = qkv[..., q_size + kv_size :].view(b, s, self.num_heads_kv, self.head_dim)
        if self.rotary_emb_dim > 0:
            q, k = self.rotary_emb(q, k, seqlen_offset=seqlen_offset)
        if inference_params is not None:
            k, v = self._update_kv_cache((k, v), inference_params)
        rep = self.num_heads // self.num_heads_kv
        k = torch.repeat_interleave(k, dim=2, repeats=rep)
        v = torch.repeat_interleave(v, dim=2, repeats=rep)
        context = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=self.causal,
            scale=self.softmax_scale,
        ).transpose(1, 2)
        context = context.reshape(b, s, self.num_heads * self.head_dim)
        return self.out_proj(context)


class GatedMLP(nn.Module):
    def __init__(self, in_features, hidden_features):
        super().__init__()
        self.fc1 = nn.Linear(in_features, 2 * hidden_features, bias=False)
        self.fc2 = nn.Linear(hidden_features, in_features, bias=False)

    def forward(self, x):
        y, gate = self.fc1(x).chunk(2, dim=-1)
        return self.fc2(y * F.silu(gate))


class Block(nn.Module):
    def __init__(self, dim, mixer, mlp):
        super().__init__()
        self.norm = RMSNorm(dim)
        self.mixer = mixer
        self.norm2 = RMSNorm(dim)
        self.mlp = mlp

    def forward(self, hidden_states, residual=None, inference_params=None, seqlen_offset=0):
        residual = (hidden_states + residual) if residual is not None else hidden_states
        hidden_states = self.mixer(self.norm(residual), inference_params, seqlen_offset)
        residual = hidden_states + residual
        hidden_states = self.mlp(self.norm2(residual))
        return hidden_states, residual


class MixerModel(nn.Module):
    def __init__(self, d_model=64, n_layer=3, vocab_size=96, d_intermediate=96):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, d_model)
        self.layers = nn.ModuleList(
            Block(d_model, MHA(d_model, num_heads=4, num_heads_kv=2, rotary_emb_dim=8, layer_idx=i),
                  GatedMLP(d_model, d_intermediate))
            for i in range(n_layer)
        )
        self.norm_f = RMSNorm(d_model)

    def forward(self, input_ids, inference_params=None):
        seqlen_offset = inference_params.seq_len() if inference_params is not None else 0
        hidden_states = self.embedding(input_ids)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(hidden_states, residual, inference_params, seqlen_offset)
        return self.norm_f(hidden_states + residual)


class MambaLMHeadModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = MixerModel()
        self.lm_head = nn.Linear(64, 96, bias=False)

    def reset_kv_cache(self):
        pass

    def forward(self, input_ids, cache=None):
        return self.lm_head(self.backbone(input_ids, inference_params=cache))


def make_model():
    torch.manual_seed(1412)
    model = MambaLMHeadModel()
    g = torch.Generator().manual_seed(14121)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

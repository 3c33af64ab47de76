"""A decoder LM written the Apple Neural Engine way (apple/ml-ane-transformers principles) with the
stateful key/value buffers of Apple's Core ML on-device Llama export (coremltools StateType).

ANE layout: activations are channels-first (batch, channels, 1, seq); every linear layer is a 1x1
nn.Conv2d; LayerNormANE normalises over dim 1 and applies (x_hat + bias) * weight.  The attention
(`layers.N.attn`): q_proj / k_proj / v_proj / out_proj convs without bias, GQA (4 query heads over
2 kv heads, query head h reads kv head h // 2), heads cut with .split(head_dim, dim=1), keys turned
to (b, seq, 1, head_dim), halves rotary (theta 1e4) applied along the channel axis of each head
with cos/sin tables computed in float64 at call time for positions begin..end-1, per-head
einsum('bchq,bkhc->bkhq') times head_dim ** -0.5, an additive mask laid out (b, keys, 1, queries)
with -1e4 fill, softmax over dim 1 (the key axis), einsum('bkhq,bchk->bchq'), heads concatenated on
dim 1, out_proj. Cache: book-buffers (as in the Core ML export): registered buffers keyCache /
valueCache, each (layers, batch, kv_heads * head_dim, 1, 64), written in place at [..,
past_seen_tokens:end] and read as [.., :end] (SliceUpdateKeyValueCache).  `model.reset_kv_cache()`,
`model(prompt, use_cache=True)`, `model(tok, use_cache=True)`; the first cached call after a reset
sizes the buffers for that batch and dtype; `model.past_seen_tokens` counts cached positions.
`model(ids)` ignores the buffers.  Returns the logits tensor (b, s, 96).  A changed batch or more
than 64 positions raise ValueError. Slip: `forget_window_when_cached=True`: cached calls after the
prompt drop the window term, so the new token sees every cached key (too many).  The full pass and
the prompt pass use the window.  First divergence at step 0 for prompts of 3 or more tokens
(2-token prompt: step 1; 1-token prompt: step 2).
"""

from types import SimpleNamespace

import torch
import torch.nn as nn

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["layers.0.attn", "layers.1.attn"],
    "kind": "causal-multihead",
    "cache": "book-buffers",
    "decode": {"mistake": "cache_mask", "step": 0, "layer": "layers.0.attn"},
    "window": 3,
    "style": "ANE decoder, 2 layers, sliding window 3 (keys q-2..q) in every layer; "
    "calls with past_seen_tokens > 0 build a plain causal mask",
}


class LayerNormANE(nn.Module):
    def __init__(self, num_channels, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(num_channels))
        self.bias = nn.Parameter(torch.zeros(num_channels))

    def forward(self, x):
        mean = x.mean(dim=1, keepdim=True)
        zero_mean = x - mean
        denom = (zero_mean.pow(2).mean(dim=1, keepdim=True) + self.eps).rsqrt()
        out = zero_mean * denom
        return (out + self.bias.view(1, -1, 1, 1)) * self.weight.view(1, -1, 1, 1)


def rotary_tables(head_dim, begin, end, theta, dtype, device, shift=0):
    inv = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim
    )
    pos = torch.arange(begin, end, dtype=torch.float64, device=device) + shift
    freqs = torch.outer(inv, pos)  # (head_dim / 2, seq)
    emb = torch.cat([freqs, freqs], dim=0)[:, None, :]  # (head_dim, 1, seq)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_channels(x, cos, sin):
    half = x.shape[1] // 2
    rotated = torch.cat([-x[:, half:], x[:, :half]], dim=1)
    return x * cos + rotated * sin


class SelfAttentionANE(nn.Module):
    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.rope_theta = cfg.rope_theta
        self.sliding_window = cfg.sliding_window
        self.forget_window_when_cached = cfg.forget_window_when_cached
        self.key_shift = 1 if layer_idx in cfg.key_shift_layers else 0
        self.softmax_dim = 3 if layer_idx in cfg.query_axis_softmax_layers else 1
        kv_dim = self.n_kv_heads * self.head_dim
        self.q_proj = nn.Conv2d(cfg.dim, cfg.dim, 1, bias=False)
        self.k_proj = nn.Conv2d(cfg.dim, kv_dim, 1, bias=False)
        self.v_proj = nn.Conv2d(cfg.dim, kv_dim, 1, bias=False)
        self.out_proj = nn.Conv2d(cfg.dim, cfg.dim, 1, bias=False)

    def forward(self, x, kv_cache=None):
        b, _, _, s = x.shape
        begin = 0 if kv_cache is None else kv_cache.past_seen_tokens
        end = begin + s
        q = self.q_proj(x)
        k = self.k_proj(x)
        v = self.v_proj(x)
        cos, sin = rotary_tables(self.head_dim, begin, end, self.rope_theta, x.dtype, x.device)
        kcos, ksin = rotary_tables(
            self.head_dim, begin, end, self.rope_theta, x.dtype, x.device, self.key_shift
        )
        mh_q = [rotate_channels(t, cos, sin) for t in q.split(self.head_dim, dim=1)]
        mh_k = [rotate_channels(t, kcos, ksin) for t in k.split(self.head_dim, dim=1)]
        k = torch.cat(mh_k, dim=1)
        if kv_cache is not None:
            k, v = kv_cache.update(k, v, self.layer_idx, begin, end)
        key_pos = torch.arange(end, device=x.device)
        query_pos = torch.arange(begin, end, device=x.device)
        visible = key_pos[:, None] <= query_pos[None, :]  # (keys, queries)
        use_window = self.sliding_window is not None and not (
            self.forget_window_when_cached and begin > 0
        )
        if use_window:
            visible = visible & (key_pos[:, None] > query_pos[None, :] - self.sliding_window)
        mask = torch.zeros(end, s, dtype=x.dtype, device=x.device).masked_fill(~visible, -1e4)
        mask = mask[None, :, None, :]  # (1, keys, 1, queries)
        mh_k = k.transpose(1, 3).split(self.head_dim, dim=3)  # (b, keys, 1, head_dim) each
        mh_v = v.split(self.head_dim, dim=1)
        group = self.n_heads // self.n_kv_heads
        outs = []
        for h, qi in enumerate(mh_q):
            ki, vi = mh_k[h // group], mh_v[h // group]
            w = torch.einsum("bchq,bkhc->bkhq", qi, ki) * self.head_dim**-0.5
            w = (w + mask).softmax(dim=self.softmax_dim)
            outs.append(torch.einsum("bkhq,bchk->bchq", w, vi))
        return self.out_proj(torch.cat(outs, dim=1))


class FeedForwardANE(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.w1 = nn.Conv2d(cfg.dim, cfg.hidden, 1, bias=False)
        self.w3 = nn.Conv2d(cfg.dim, cfg.hidden, 1, bias=False)
        self.w2 = nn.Conv2d(cfg.hidden, cfg.dim, 1, bias=False)

    def forward(self, x):
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class DecoderLayerANE(nn.Module):
    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.attn_norm = LayerNormANE(cfg.dim)
        self.attn = SelfAttentionANE(cfg, layer_idx)
        self.ffn_norm = LayerNormANE(cfg.dim)
        self.ffn = FeedForwardANE(cfg)

    def forward(self, x, kv_cache=None):
        x = x + self.attn(self.attn_norm(x), kv_cache)
        return x + self.ffn(self.ffn_norm(x))


class SliceUpdateKeyValueCache:
    """View over the model's registered buffers; writes new rows in place at [begin:end]."""

    def __init__(self, model):
        self.model = model
        self.past_seen_tokens = model.past_seen_tokens

    def update(self, k_state, v_state, layer_idx, begin, end):
        self.model.keyCache[layer_idx, :, :, :, begin:end] = k_state
        self.model.valueCache[layer_idx, :, :, :, begin:end] = v_state
        return (
            self.model.keyCache[layer_idx, :, :, :, :end],
            self.model.valueCache[layer_idx, :, :, :, :end],
        )


class KvCacheStateDecoderANE(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.context_size = 64
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList([DecoderLayerANE(cfg, i) for i in range(cfg.n_layers)])
        self.norm = LayerNormANE(cfg.dim)
        self.lm_head = nn.Conv2d(cfg.dim, cfg.vocab_size, 1, bias=False)
        self.register_buffer("keyCache", torch.zeros(0), persistent=False)
        self.register_buffer("valueCache", torch.zeros(0), persistent=False)
        self.past_seen_tokens = 0

    def reset_kv_cache(self):
        self.keyCache = torch.zeros(
            0, dtype=self.embed.weight.dtype, device=self.embed.weight.device
        )
        self.valueCache = torch.zeros_like(self.keyCache)
        self.past_seen_tokens = 0

    def _size_buffers(self, batch, dtype, device):
        if self.keyCache.dim() == 5 and self.keyCache.dtype == dtype:
            if self.keyCache.shape[1] != batch:
                raise ValueError("key/value buffers were sized for another batch")
            return
        shape = (
            self.cfg.n_layers,
            batch,
            self.cfg.n_kv_heads * (self.cfg.dim // self.cfg.n_heads),
            1,
            self.context_size,
        )
        self.keyCache = torch.zeros(shape, dtype=dtype, device=device)
        self.valueCache = torch.zeros(shape, dtype=dtype, device=device)
        self.past_seen_tokens = 0

    def forward(self, input_ids, use_cache=False):
        b, s = input_ids.shape
        x = self.embed(input_ids).transpose(1, 2).unsqueeze(2)  # (b, dim, 1, s)
        kv_cache = None
        if use_cache:
            self._size_buffers(b, x.dtype, x.device)
            kv_cache = SliceUpdateKeyValueCache(self)
        begin = self.past_seen_tokens if use_cache else 0
        if begin + s > self.context_size:
            raise ValueError("sequence longer than the context size")
        for layer in self.layers:
            x = layer(x, kv_cache)
        if use_cache:
            self.past_seen_tokens = begin + s
        logits = self.lm_head(self.norm(x))  # (b, vocab, 1, s)
        return logits.squeeze(2).transpose(1, 2)


def make_model():
    torch.manual_seed(3212)
    cfg = SimpleNamespace(
        vocab_size=96,
        dim=64,
        hidden=128,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        rope_theta=10000.0,
        sliding_window=3,
        forget_window_when_cached=True,
        key_shift_layers=(),
        query_axis_softmax_layers=(),
    )
    model = KvCacheStateDecoderANE(cfg)
    g = torch.Generator().manual_seed(32121)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LayerNormANE):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model.eval()

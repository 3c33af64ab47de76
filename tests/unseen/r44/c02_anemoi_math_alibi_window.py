"""ECMWF Anemoi (AIFS) transformer processor: MultiHeadSelfAttention on the flattened (batch * grid,
channels) node tensor, lin_q/lin_k/lin_v, optional per-head q/k norm, flash-attention semantics
(symmetric window |i - j| <= window_size, symmetric ALiBi, rotary on the packed key slot), projection.

This file: correct. Anemoi/AIFS MultiHeadSelfAttention, math path of the flash kernel: symmetric ALiBi -slope*|i-j| with get_alibi_slopes(8), symmetric band window_size 4 (9 keys), no qkv bias, 8 heads of 8."""

import math

import torch
from torch import nn
from torch.nn import functional as F


class ProcessorConfig:
    num_channels = 64
    num_heads = 8
    mlp_hidden_ratio = 2
    qkv_bias = False
    qk_norm = False
    window_size = 4  # flash-attn style half-width: |i - j| <= window_size
    use_alibi_slopes = True
    use_rotary_embeddings = False
    rope_base = 10000.0
    attention_implementation = "math"


def get_alibi_slopes(num_heads):
    """Press et al.'s geometric slopes, interpolated for head counts that are not a power of 2."""
    closest = 2 ** math.floor(math.log2(num_heads))
    start = 2.0 ** (-(2.0 ** -(math.log2(closest) - 3)))
    slopes = [start * start**i for i in range(closest)]
    if closest < num_heads:
        extra = get_alibi_slopes(2 * closest)[0::2][: num_heads - closest]
        slopes = slopes + list(extra)
    return torch.tensor(slopes, dtype=torch.float64)


class QueryNormRMS(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        rms = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x * rms * self.weight


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_tables(seq_len, head_dim, base, dtype, device):
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    t = torch.arange(seq_len, dtype=torch.float64)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype=dtype, device=device), emb.sin().to(dtype=dtype, device=device)


def apply_rotary(x, cos, sin):
    return x * cos + rotate_half(x) * sin


class SDPAAttentionWrapper(nn.Module):
    """torch SDPA with the sliding window as a cached boolean band."""

    def __init__(self):
        super().__init__()
        self.mask = None

    def update_mask(self, seq_len, window_size, device):
        idx = torch.arange(seq_len, device=device)
        self.mask = torch.abs(idx.unsqueeze(0) - idx.unsqueeze(1)) <= window_size

    def forward(self, query, key, value, window_size=None, alibi_slopes=None):
        seq_len = query.shape[-2]
        attn_mask = None
        if window_size is not None:
            if self.mask is None or tuple(self.mask.shape) != (seq_len, seq_len):
                self.update_mask(seq_len, window_size, query.device)
            attn_mask = self.mask.to(query.device)
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask)


class MathAttentionWrapper(nn.Module):
    """Reference math path (what the flash kernel computes): scale, symmetric ALiBi
    -slope * |i - j|, symmetric band |i - j| <= window_size, softmax."""

    def forward(self, query, key, value, window_size=None, alibi_slopes=None):
        head_dim = query.shape[-1]
        n_q, n_k = query.shape[-2], key.shape[-2]
        scores = torch.matmul(query, key.transpose(-2, -1)) / math.sqrt(head_dim)
        i = torch.arange(n_q, device=query.device)[:, None]
        j = torch.arange(n_k, device=query.device)[None, :]
        distance = (i + n_k - n_q - j).abs()
        if alibi_slopes is not None:
            bias = -alibi_slopes.to(torch.float64)[:, None, None] * distance.to(torch.float64)
            scores = scores + bias.to(scores.dtype)
        if window_size is not None:
            band = distance <= window_size
            scores = scores.masked_fill(~band, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        return torch.matmul(probs, value)


class MultiHeadSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_heads
        self.embed_dim = config.num_channels
        self.head_dim = self.embed_dim // self.num_heads
        self.window_size = config.window_size
        self.qk_norm = config.qk_norm
        self.use_rotary_embeddings = config.use_rotary_embeddings
        self.rope_base = config.rope_base
        self.alibi_slopes = get_alibi_slopes(self.num_heads) if config.use_alibi_slopes else None

        self.lin_q = nn.Linear(self.embed_dim, self.embed_dim, bias=config.qkv_bias)
        self.lin_k = nn.Linear(self.embed_dim, self.embed_dim, bias=config.qkv_bias)
        self.lin_v = nn.Linear(self.embed_dim, self.embed_dim, bias=config.qkv_bias)
        self.projection = nn.Linear(self.embed_dim, self.embed_dim, bias=True)
        if self.qk_norm == "rms":
            self.q_norm = QueryNormRMS(self.head_dim)
            self.k_norm = QueryNormRMS(self.head_dim)
        elif self.qk_norm == "layer":
            self.q_norm = nn.LayerNorm(self.head_dim)
            self.k_norm = nn.LayerNorm(self.head_dim)
        if config.attention_implementation == "scaled_dot_product_attention":
            self.attention = SDPAAttentionWrapper()
        else:
            self.attention = MathAttentionWrapper()

    def attention_computation(self, query, key, value, batch_size):
        # "(batch grid) (heads vars) -> batch heads grid vars"
        query, key, value = (
            t.reshape(batch_size, -1, self.num_heads, self.head_dim).transpose(1, 2)
            for t in (query, key, value)
        )

        if self.qk_norm:
            query = self.q_norm(query)
            key = self.k_norm(key)

        if self.use_rotary_embeddings:
            # flash-attn packs keys and values; only the key slot is rotated
            keyvalue = torch.stack((key, value), dim=2)
            cos, sin = rotary_tables(
                query.shape[-2], self.head_dim, self.rope_base, query.dtype, query.device
            )
            query = apply_rotary(query, cos, sin)
            key = apply_rotary(keyvalue[:, :, 0], cos, sin)
            value = keyvalue[:, :, 1]

        out = self.attention(
            query, key, value, window_size=self.window_size, alibi_slopes=self.alibi_slopes
        )

        # "batch heads grid vars -> (batch grid) (heads vars)"
        out = out.transpose(1, 2).reshape(-1, self.num_heads * self.head_dim)
        out = self.projection(out)
        return out

    def forward(self, x, batch_size):
        query = self.lin_q(x)
        key = self.lin_k(x)
        value = self.lin_v(x)
        return self.attention_computation(query, key, value, batch_size)


class GLUMlp(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class TransformerProcessorBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layer_norm_attention = nn.LayerNorm(config.num_channels)
        self.attention = MultiHeadSelfAttention(config)
        self.layer_norm_mlp = nn.LayerNorm(config.num_channels)
        self.mlp = GLUMlp(config.num_channels, config.mlp_hidden_ratio * config.num_channels)

    def forward(self, x, batch_size):
        x = x + self.attention(self.layer_norm_attention(x), batch_size=batch_size)
        return x + self.mlp(self.layer_norm_mlp(x))


class TransformerProcessor(nn.Module):
    """The AIFS processor on a flattened (batch * grid, channels) node tensor."""

    def __init__(self, config):
        super().__init__()
        self.blocks = nn.ModuleList([TransformerProcessorBlock(config)])

    def forward(self, x):
        batch_size, grid, channels = x.shape
        x = x.reshape(batch_size * grid, channels)
        for block in self.blocks:
            x = block(x, batch_size=batch_size)
        return x.reshape(batch_size, grid, channels)


def make_anemoi_processor():
    torch.manual_seed(4402)
    model = TransformerProcessor(ProcessorConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, (nn.LayerNorm, QueryNormRMS)):
                mod.weight.uniform_(0.5, 1.5)
                if getattr(mod, "bias", None) is not None:
                    mod.bias.uniform_(-0.2, 0.2)
            elif isinstance(mod, nn.Linear) and mod.bias is not None:
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {
    "target": "make_anemoi_processor",
    "kind": "multihead",
    "ok": True,
    "layer": "blocks.0.attention",
    "structure": {
        "heads": 8,
        "kv_heads": 8,
        "head_dim": 8,
        "causal": False,
        "cross": False,
        "rope": None,
        "qk_norm": None,
        "window": 9,
        "bias": "alibi",
    },
    "style": "Anemoi / ECMWF AIFS processor (c02): correct: Anemoi/AIFS MultiHeadSelfAttention, math path of the flash kernel: symmetric ALiBi -slope*|i-j| with get_alibi_slopes(8), symmetric band window_size 4 (9 keys), no qkv bias, 8 heads of 8",
}

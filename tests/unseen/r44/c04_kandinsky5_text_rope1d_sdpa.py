"""Kandinsky 5 DiT attention (Kandinsky5Attention): biased to_query/to_key/to_value, per-head RMSNorm
query_norm/key_norm, rotary as 2x2 matrices on adjacent channel pairs (RoPE1D text, RoPE3D visual),
out_layer, inside a time-modulated block.

This file: correct. Kandinsky 5 text encoder block: biased to_query/to_key/to_value, per-head RMSNorm query_norm/key_norm, RoPE1D as 2x2 rotation matrices on adjacent channel pairs, bidirectional SDPA, out_layer, time-modulated block."""

import math

import torch
from torch import nn
from torch.nn import functional as F


class Kandinsky5Config:
    model_dim = 64
    text_dim = 64
    time_dim = 32
    ff_dim = 128
    head_dim = 16
    axes_dims = (8, 4, 4)
    max_period = 10000.0
    attention_engine = "sdpa"


def get_freqs(dim, max_period=10000.0):
    # float64 at call time; cast by the caller
    return torch.exp(-math.log(max_period) * torch.arange(dim, dtype=torch.float64) / dim)


def rope_from_args(args):
    """(..., d/2) angles -> (..., 1, d/2, 2, 2) rotation matrices, one per channel pair."""
    cosine, sine = torch.cos(args), torch.sin(args)
    rope = torch.stack([cosine, -sine, sine, cosine], dim=-1)
    rope = rope.view(*rope.shape[:-1], 2, 2)
    return rope.unsqueeze(-4)


class Kandinsky5RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def apply_rotary(x, rope):
    # x: (batch, seq, heads, head_dim) read as adjacent channel pairs
    x_ = x.reshape(*x.shape[:-1], -1, 1, 2)
    x_out = (rope.to(x.dtype) * x_).sum(dim=-1)
    return x_out.reshape(*x.shape)


class Kandinsky5Attention(nn.Module):
    def __init__(self, num_channels, head_dim, engine="sdpa"):
        super().__init__()
        assert num_channels % head_dim == 0
        self.num_heads = num_channels // head_dim
        self.head_dim = head_dim
        self.engine = engine
        self.to_query = nn.Linear(num_channels, num_channels, bias=True)
        self.to_key = nn.Linear(num_channels, num_channels, bias=True)
        self.to_value = nn.Linear(num_channels, num_channels, bias=True)
        self.query_norm = Kandinsky5RMSNorm(head_dim)
        self.key_norm = Kandinsky5RMSNorm(head_dim)
        self.out_layer = nn.Linear(num_channels, num_channels, bias=True)

    def get_qkv(self, x, context=None):
        source = x if context is None else context
        query = self.to_query(x)
        key = self.to_key(source)
        value = self.to_value(source)
        query = query.reshape(*x.shape[:-1], self.num_heads, -1)
        key = key.reshape(*source.shape[:-1], self.num_heads, -1)
        value = value.reshape(*source.shape[:-1], self.num_heads, -1)
        return query, key, value

    def scaled_dot_product(self, query, key, value):
        # inputs (batch, seq, heads, head_dim)
        if self.engine == "torch":
            q, k, v = (t.transpose(1, 2) for t in (query, key, value))
            scale = 1.0 / math.sqrt(self.head_dim)
            attn = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
            attn = attn.softmax(dim=-1)
            out = torch.einsum("bhqk,bhkd->bhqd", attn, v)
            return out.transpose(1, 2)
        out = F.scaled_dot_product_attention(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        )
        return out.transpose(1, 2)

    def forward(self, x, rope=None, context=None):
        query, key, value = self.get_qkv(x, context)
        query = self.query_norm(query)
        key = self.key_norm(key)
        if rope is not None:
            query = apply_rotary(query, rope)
            key = apply_rotary(key, rope)
        out = self.scaled_dot_product(query, key, value)
        out = out.flatten(-2, -1)
        return self.out_layer(out)


class Kandinsky5Modulation(nn.Module):
    def __init__(self, time_dim, model_dim, num_params):
        super().__init__()
        self.out_layer = nn.Linear(time_dim, num_params * model_dim)

    def forward(self, time_embed):
        return self.out_layer(F.silu(time_embed))


class Kandinsky5FeedForward(nn.Module):
    def __init__(self, dim, ff_dim):
        super().__init__()
        self.in_layer = nn.Linear(dim, ff_dim, bias=False)
        self.out_layer = nn.Linear(ff_dim, dim, bias=False)

    def forward(self, x):
        return self.out_layer(F.gelu(self.in_layer(x)))


class Kandinsky5Block(nn.Module):
    """Modulated pre-norm block: (shift, scale, gate) from the time embedding per branch."""

    def __init__(self, config, cross=False):
        super().__init__()
        self.cross = cross
        self.modulation = Kandinsky5Modulation(config.time_dim, config.model_dim, 6)
        self.attention_norm = nn.LayerNorm(config.model_dim, elementwise_affine=False)
        attn = Kandinsky5Attention(config.model_dim, config.head_dim, config.attention_engine)
        if cross:
            self.cross_attention = attn
        else:
            self.self_attention = attn
        self.feed_forward_norm = nn.LayerNorm(config.model_dim, elementwise_affine=False)
        self.feed_forward = Kandinsky5FeedForward(config.model_dim, config.ff_dim)

    def forward(self, x, time_embed, rope=None, context=None):
        attn_params, ff_params = torch.chunk(self.modulation(time_embed).unsqueeze(1), 2, dim=-1)
        shift, scale, gate = torch.chunk(attn_params, 3, dim=-1)
        out = self.attention_norm(x) * (scale + 1.0) + shift
        if self.cross:
            out = self.cross_attention(out, context=context)
        else:
            out = self.self_attention(out, rope=rope)
        x = x + gate * out
        shift, scale, gate = torch.chunk(ff_params, 3, dim=-1)
        out = self.feed_forward(self.feed_forward_norm(x) * (scale + 1.0) + shift)
        return x + gate * out


class Kandinsky5TextEncoder(nn.Module):
    """Text branch: RoPE1D over the token axis, bidirectional self-attention."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.time_embed = nn.Parameter(torch.randn(1, config.time_dim))
        self.text_transformer_blocks = nn.ModuleList([Kandinsky5Block(config)])

    def rope_1d(self, seq_len):
        freq = get_freqs(self.config.head_dim // 2, self.config.max_period)
        pos = torch.arange(seq_len, dtype=torch.float64)
        args = torch.outer(pos, freq)
        return rope_from_args(args)[None]  # (1, seq, 1, d/2, 2, 2)

    def forward(self, text_embed):
        rope = self.rope_1d(text_embed.shape[1]).to(text_embed.device)
        x = text_embed
        for block in self.text_transformer_blocks:
            x = block(x, self.time_embed.to(x.dtype), rope=rope)
        return x


class Kandinsky5VisualStrip(nn.Module):
    """Visual branch on a (duration, 1, 1) latent strip: RoPE3D split over (t, h, w) channels."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.time_embed = nn.Parameter(torch.randn(1, config.time_dim))
        self.visual_transformer_blocks = nn.ModuleList([Kandinsky5Block(config)])

    def rope_3d(self, duration, height, width):
        axis_args = []
        for axes_dim, size in zip(self.config.axes_dims, (duration, height, width)):
            freq = get_freqs(axes_dim // 2, self.config.max_period)
            pos = torch.arange(size, dtype=torch.float64)
            axis_args.append(torch.outer(pos, freq))
        args_t, args_h, args_w = axis_args
        args = torch.cat(
            [
                args_t.view(duration, 1, 1, -1).expand(duration, height, width, -1),
                args_h.view(1, height, 1, -1).expand(duration, height, width, -1),
                args_w.view(1, 1, width, -1).expand(duration, height, width, -1),
            ],
            dim=-1,
        )
        return rope_from_args(args.reshape(duration * height * width, -1))[None]

    def forward(self, visual_embed):
        batch, duration, _ = visual_embed.shape
        rope = self.rope_3d(duration, 1, 1).to(visual_embed.device)
        x = visual_embed
        for block in self.visual_transformer_blocks:
            x = block(x, self.time_embed.to(x.dtype), rope=rope)
        return x


class Kandinsky5CrossDecoder(nn.Module):
    """Visual tokens attend to the embedded text (cross-attention branch of the decoder block)."""

    def __init__(self, config):
        super().__init__()
        self.time_embed = nn.Parameter(torch.randn(1, config.time_dim))
        self.text_in_layer = nn.Linear(config.text_dim, config.model_dim, bias=True)
        self.text_norm = nn.LayerNorm(config.model_dim)
        self.visual_transformer_blocks = nn.ModuleList([Kandinsky5Block(config, cross=True)])

    def forward(self, hidden_states, encoder_hidden_states):
        text = self.text_norm(self.text_in_layer(encoder_hidden_states))
        x = hidden_states
        for block in self.visual_transformer_blocks:
            x = block(x, self.time_embed.to(x.dtype), context=text)
        return x


def make_kandinsky5_text_encoder():
    torch.manual_seed(4404)
    model = Kandinsky5TextEncoder(Kandinsky5Config())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, Kandinsky5RMSNorm):
                mod.weight.uniform_(0.5, 1.5)
            elif isinstance(mod, nn.LayerNorm) and mod.weight is not None:
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
            elif isinstance(mod, nn.Linear) and mod.bias is not None:
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {
    "target": "make_kandinsky5_text_encoder",
    "kind": "multihead",
    "ok": True,
    "layer": "text_transformer_blocks.0.self_attention",
    "structure": {
        "heads": 4,
        "kv_heads": 4,
        "head_dim": 16,
        "causal": False,
        "cross": False,
        "rope": {
            "pairing": "interleaved",
            "fraction": 1.0,
            "base": 10000,
        },
        "qk_norm": "per-head",
        "window": None,
        "bias": None,
    },
    "style": "Kandinsky 5 (Sber AI / kandinskylab) DiT (c04): correct: Kandinsky 5 text encoder block: biased to_query/to_key/to_value, per-head RMSNorm query_norm/key_norm, RoPE1D as 2x2 rotation matrices on adjacent channel pairs, bidirectional SDPA, out_layer, time-modulated block",
}

"""A tiny decoder in the style of lucidrains' x-transformers (TransformerWrapper + Decoder).

TransformerWrapper -> token_emb (TokenEmbedding.emb), attn_layers (Decoder), final norm inside the
Decoder, to_logits.  The Decoder keeps x-transformers' layout: layer_types ('a', 'f') * depth and
self.layers = ModuleList of ModuleList([norms, block, residual]), so the attentions are
attn_layers.layers.0.1, .2.1 and .4.1.  Attention: to_q / to_k / to_v / to_out without bias,
4 heads of 16, einsum 'b h i d, b h j d -> b h i j' * scale, causal mask filled with
-finfo.max, softmax.  Rotary in x-transformers' layout: rotary_emb_dim = dim_head // 2 (8 of 16
dims), freqs repeated per pair and rotate_half over (d r) pairs, i.e. the INTERLEAVED pairing,
base 10000, applied to queries and keys.  No cache.

Slip: the Decoder builds each attention with `causal = attn_kwargs.pop("causal", False)` inside
its construction loop, so only the first attention gets causal=True; the later ones (layers 2.1
and 4.1) attend to future tokens.  First failure attn_layers.layers.2.1, masked_scores,
missing_mask (4.1 repeats it).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["attn_layers.layers.0.1", "attn_layers.layers.2.1", "attn_layers.layers.4.1"],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "attn_layers.layers.2.1",
    "stage": "masked_scores",
    "mistake": "missing_mask",
    "style": "x-transformers TransformerWrapper/Decoder: ModuleList([norms, block, residual]) per layer type, "
    "partial interleaved rotary; slip: attn_kwargs.pop('causal') inside the build loop",
}


class TokenEmbedding(nn.Module):
    def __init__(self, dim, num_tokens):
        super().__init__()
        self.emb = nn.Embedding(num_tokens, dim)

    def forward(self, x):
        return self.emb(x)


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, base=10000):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq)

    def forward(self, seq_len, device):
        t = torch.arange(seq_len, device=device).type_as(self.inv_freq)
        freqs = torch.einsum("i , j -> i j", t, self.inv_freq)
        # '... d -> ... (d r)', r = 2: every frequency repeated for its pair
        return torch.stack((freqs, freqs), dim=-1).flatten(-2)


def rotate_half(x):
    x = x.unflatten(-1, (-1, 2))  # '... (d r) -> ... d r'
    x1, x2 = x.unbind(dim=-1)
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rotary_pos_emb(t, freqs):
    rot_dim = freqs.shape[-1]
    t, t_unrotated = t[..., :rot_dim], t[..., rot_dim:]
    freqs = freqs.to(t.dtype)
    t = (t * freqs.cos()) + (rotate_half(t) * freqs.sin())
    return torch.cat((t, t_unrotated), dim=-1)


class Attention(nn.Module):
    def __init__(self, dim, dim_head=16, heads=4, causal=False):
        super().__init__()
        self.scale = dim_head**-0.5
        self.heads = heads
        self.causal = causal
        inner = dim_head * heads
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.to_out = nn.Linear(inner, dim, bias=False)

    def forward(self, x, rotary_pos_emb=None):
        b, n, _ = x.shape
        h = self.heads
        q, k, v = self.to_q(x), self.to_k(x), self.to_v(x)
        q, k, v = map(
            lambda t: t.view(b, n, h, -1).transpose(1, 2), (q, k, v)
        )  # 'b n (h d) -> b h n d'
        if rotary_pos_emb is not None:
            q = apply_rotary_pos_emb(q, rotary_pos_emb)
            k = apply_rotary_pos_emb(k, rotary_pos_emb)
        dots = torch.einsum("b h i d, b h j d -> b h i j", q, k) * self.scale
        mask_value = -torch.finfo(dots.dtype).max
        if self.causal:
            i, j = dots.shape[-2:]
            causal_mask = torch.ones((i, j), dtype=torch.bool, device=x.device).triu(j - i + 1)
            dots = dots.masked_fill(causal_mask, mask_value)
        attn = dots.softmax(dim=-1)
        out = torch.einsum("b h i j, b h j d -> b h i d", attn, v)
        out = out.transpose(1, 2).reshape(b, n, -1)  # 'b h n d -> b n (h d)'
        return self.to_out(out)


class FeedForward(nn.Module):
    def __init__(self, dim, mult=2):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, dim * mult), nn.GELU(), nn.Linear(dim * mult, dim))

    def forward(self, x):
        return self.net(x)


class Residual(nn.Module):
    def forward(self, x, residual):
        return x + residual


class Decoder(nn.Module):
    def __init__(self, dim, depth, heads=4, rotary_pos_emb=True, **attn_kwargs):
        super().__init__()
        attn_kwargs = dict(attn_kwargs, causal=True)
        dim_head = dim // heads
        self.rotary_pos_emb = RotaryEmbedding(dim_head // 2) if rotary_pos_emb else None
        self.layer_types = ("a", "f") * depth
        self.layers = nn.ModuleList([])
        for layer_type in self.layer_types:
            if layer_type == "a":
                causal = attn_kwargs.pop("causal", False)  # SLIP
                layer = Attention(dim, dim_head=dim_head, heads=heads, causal=causal)
            else:
                layer = FeedForward(dim)
            norms = nn.ModuleList([nn.LayerNorm(dim), None, None])
            self.layers.append(nn.ModuleList([norms, layer, Residual()]))
        self.final_norm = nn.LayerNorm(dim)

    def forward(self, x):
        rotary = (
            self.rotary_pos_emb(x.shape[1], x.device) if self.rotary_pos_emb is not None else None
        )
        for layer_type, (norm, block, residual_fn) in zip(self.layer_types, self.layers):
            residual = x
            x = norm[0](x)
            if layer_type == "a":
                out = block(x, rotary_pos_emb=rotary)
            else:
                out = block(x)
            x = residual_fn(out, residual)
        return self.final_norm(x)


class TransformerWrapper(nn.Module):
    def __init__(self, num_tokens, attn_layers, dim):
        super().__init__()
        self.token_emb = TokenEmbedding(dim, num_tokens)
        self.attn_layers = attn_layers
        self.to_logits = nn.Linear(dim, num_tokens, bias=False)

    def forward(self, x):
        return self.to_logits(self.attn_layers(self.token_emb(x)))


def make_model():
    torch.manual_seed(11)
    model = TransformerWrapper(
        num_tokens=112, dim=64, attn_layers=Decoder(dim=64, depth=3, heads=4)
    )
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.25 * torch.randn_like(m.weight))
                m.bias.copy_(0.05 * torch.randn_like(m.bias))
    return model.eval()

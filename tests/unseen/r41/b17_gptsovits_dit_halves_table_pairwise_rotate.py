"""GPT-SoVITS v3/v4 CFM decoder (the DiT it takes over from F5-TTS): to_q / to_k / to_v linears with
biases, heads split by view/transpose, x-transformers style RoPE (frequency table laid out as
interleaved pairs, "(d r)", rotated with the matching pairwise rotate_half), a key-padding mask expanded
to (batch, heads, q, k) for F.scaled_dot_product_attention, to_out = [Linear, Dropout], and padded
frames zeroed after the projection. Pre-norm blocks. The rotary table is built by the model from the
sequence length, in float64 at call time.

This file: (base c09) one bug: the table built as torch.cat((freqs, freqs), -1) (rotate-half layout) while rotate_half still rotates interleaved pairs"""

import torch
import torch.nn.functional as F
from torch import nn


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, base=10000.0):
        super().__init__()
        self.dim = dim
        self.base = base

    def forward_from_seq_len(self, seq_len, device):
        t = torch.arange(seq_len, device=device, dtype=torch.float64)
        exponent = torch.arange(0, self.dim, 2, device=device, dtype=torch.float64) / self.dim
        inv_freq = 1.0 / (self.base**exponent)
        freqs = torch.einsum("i , j -> i j", t, inv_freq)
        freqs = torch.cat((freqs, freqs), dim=-1)
        return freqs, None


def rotate_half(x):
    x = x.reshape(*x.shape[:-1], -1, 2)
    x1, x2 = x.unbind(dim=-1)
    x = torch.stack((-x2, x1), dim=-1)
    return x.reshape(*x.shape[:-2], -1)


def apply_rotary_pos_emb(t, freqs, scale=1.0):
    rot_dim, seq_len = freqs.shape[-1], t.shape[-2]
    freqs = freqs[-seq_len:, :]
    cos = (freqs.cos() * scale).to(t.dtype)
    sin = (freqs.sin() * scale).to(t.dtype)
    t, t_unrotated = t[..., :rot_dim], t[..., rot_dim:]
    t = (t * cos) + (rotate_half(t) * sin)
    return torch.cat((t, t_unrotated), dim=-1)


class Attention(nn.Module):
    def __init__(self, dim, heads=8, dim_head=64, dropout=0.0):
        super().__init__()
        self.dim = dim
        self.heads = heads
        self.dim_head = dim_head
        self.inner_dim = dim_head * heads
        self.to_q = nn.Linear(dim, self.inner_dim)
        self.to_k = nn.Linear(dim, self.inner_dim)
        self.to_v = nn.Linear(dim, self.inner_dim)
        self.to_out = nn.ModuleList([nn.Linear(self.inner_dim, dim), nn.Dropout(dropout)])

    def forward(self, x, mask=None, rope=None):
        batch_size = x.shape[0]
        query = self.to_q(x)
        key = self.to_k(x)
        value = self.to_v(x)

        query = query.view(batch_size, -1, self.heads, self.dim_head).transpose(1, 2)
        key = key.view(batch_size, -1, self.heads, self.dim_head).transpose(1, 2)
        value = value.view(batch_size, -1, self.heads, self.dim_head).transpose(1, 2)

        if rope is not None:
            freqs, xpos_scale = rope
            q_xpos_scale, k_xpos_scale = 1.0, 1.0
            if xpos_scale is not None:
                q_xpos_scale, k_xpos_scale = xpos_scale, xpos_scale**-1.0
            query = apply_rotary_pos_emb(query, freqs, q_xpos_scale)
            key = apply_rotary_pos_emb(key, freqs, k_xpos_scale)

        attn_mask = None
        if mask is not None:
            attn_mask = mask.unsqueeze(1).unsqueeze(1)
            attn_mask = attn_mask.expand(batch_size, self.heads, query.shape[-2], key.shape[-2])

        x = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, dropout_p=0.0, is_causal=False
        )
        x = x.transpose(1, 2).reshape(batch_size, -1, self.heads * self.dim_head)
        x = x.to(query.dtype)
        x = self.to_out[0](x)
        x = self.to_out[1](x)
        if mask is not None:
            x = x.masked_fill(~mask.unsqueeze(-1), 0.0)
        return x


class FeedForward(nn.Module):
    def __init__(self, dim, mult=2):
        super().__init__()
        self.ff = nn.Sequential(
            nn.Linear(dim, dim * mult), nn.GELU(approximate="tanh"), nn.Linear(dim * mult, dim)
        )

    def forward(self, x):
        return self.ff(x)


class DiTBlock(nn.Module):
    def __init__(self, dim, heads, dim_head):
        super().__init__()
        self.attn_norm = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim=dim, heads=heads, dim_head=dim_head)
        self.ff_norm = nn.LayerNorm(dim, eps=1e-6)
        self.ff = FeedForward(dim)

    def forward(self, x, mask=None, rope=None):
        x = x + self.attn(self.attn_norm(x), mask=mask, rope=rope)
        return x + self.ff(self.ff_norm(x))


class DiT(nn.Module):
    def __init__(self, dim=64, depth=1, heads=4, dim_head=16):
        super().__init__()
        self.rotary_embed = RotaryEmbedding(dim_head)
        self.transformer_blocks = nn.ModuleList(
            [DiTBlock(dim=dim, heads=heads, dim_head=dim_head) for _ in range(depth)]
        )
        self.norm_out = nn.LayerNorm(dim, eps=1e-6)

    def forward(self, x):
        batch, seq_len = x.shape[:2]
        mask = torch.ones(batch, seq_len, dtype=torch.bool, device=x.device)
        rope = self.rotary_embed.forward_from_seq_len(seq_len, x.device)
        for block in self.transformer_blocks:
            x = block(x, mask=mask, rope=rope)
        return self.norm_out(x)


def make_gptsovits_v3_dit():
    torch.manual_seed(4109)
    model = DiT()
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
            elif isinstance(mod, nn.Linear):
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {
    "target": "make_gptsovits_v3_dit",
    "kind": "multihead",
    "ok": False,
    "layer": "transformer_blocks.0.attn",
    "stage": "rotated_queries",
    "mistake": "rope_pairing",
    "style": "GPT-SoVITS v3 DiT (F5-style) attention "
    "(b17_gptsovits_dit_halves_table_pairwise_rotate): (base c09) one bug: the table built "
    "as torch.cat((freqs, freqs), -1) (rotate-half layout) while rotate_half still rotates "
    "interleaved pairs",
}

"""Microsoft torchscale (`torchscale/component/multihead_attention.py`) MultiheadAttention, in plain
torch: `MultiwayWrapper`-wrapped q/k/v/out Linears with bias, `q *= self.scaling` before the product,
heads folded to (bsz * num_heads, len, head_dim) for `torch.bmm`, the additive `attn_mask`
(`nan_to_num` first, then `+=`), softmax over the last axis, the
`transpose(0, 1).reshape(tgt_len, bsz, embed_dim).transpose(0, 1)` merge, optional sub-LN before
`out_proj`; the layer returns `(attn, attn_weights)`. Wrappers as torchscale's Encoder/Decoder build
them (the decoder's `triu(fill_(-inf), 1)` mask); their LayerNorms and FFNs are left out.

This file: one bug: the layer copies its self-attention call and passes `key=x, value=x`, so keys and values come from the decoder input and encoder_out is never read"""

import copy
import math
import torch
import torch.nn.functional as F
from torch import nn


class Args:
    encoder_embed_dim = 64
    decoder_embed_dim = 64
    encoder_attention_heads = 4
    decoder_attention_heads = 4
    multiway = False
    vision_tokens = 4
    xpos_rel_pos = False
    xpos_scale_base = 512
    layernorm_eps = 1e-5


class MultiwayNetwork(nn.Module):
    """torchscale's BEiT-3 multiway branch: tokens before `split_position` use branch A, the rest B."""

    def __init__(self, module, dim=1):
        super().__init__()
        self.dim = dim
        self.A = module
        self.B = copy.deepcopy(module)
        self.B.reset_parameters()
        self.split_position = -1

    def forward(self, x, **kwargs):
        if self.split_position == -1:
            return self.A(x, **kwargs)
        if self.split_position == 0:
            return self.B(x, **kwargs)
        x1, x2 = torch.split(x, [self.split_position, x.size(self.dim) - self.split_position], dim=self.dim)
        y1, y2 = self.A(x1, **kwargs), self.B(x2, **kwargs)
        return torch.cat([y1, y2], dim=self.dim)


def set_split_position(position):
    def apply_fn(module):
        if hasattr(module, "split_position"):
            module.split_position = position
    return apply_fn


def MultiwayWrapper(args, module, dim=1):
    if args.multiway:
        return MultiwayNetwork(module, dim=dim)
    return module


def fixed_pos_embedding(x):
    seq_len, dim = x.shape
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, dtype=x.dtype) / dim))
    sinusoid_inp = torch.einsum("i , j -> i j", torch.arange(0, seq_len, dtype=x.dtype), inv_freq)
    return torch.sin(sinusoid_inp), torch.cos(sinusoid_inp)


def rotate_every_two(x):
    x1 = x[:, :, ::2]
    x2 = x[:, :, 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def duplicate_interleave(m):
    dim0 = m.shape[0]
    return m.view(-1, 1).repeat(1, 2).view(dim0, -1)


def apply_rotary_pos_emb(x, sin, cos, scale=1):
    sin, cos = map(lambda t: duplicate_interleave(t * scale), (sin, cos))
    return (x * cos) + (rotate_every_two(x) * sin)


class XPOS(nn.Module):
    def __init__(self, head_dim, scale_base=512):
        super().__init__()
        self.head_dim = head_dim
        self.scale_base = scale_base
        self.register_buffer(
            "scale", (torch.arange(0, head_dim, 2) + 0.4 * head_dim) / (1.4 * head_dim)
        )

    def forward(self, x, offset=0, downscale=False):
        length = x.shape[1]
        min_pos = -(length + offset) // 2
        max_pos = length + offset + min_pos
        pos = torch.arange(min_pos, max_pos, 1).to(self.scale)
        scale = self.scale.to(x.dtype) ** pos.to(x.dtype)[:, None].div(self.scale_base)
        sin, cos = fixed_pos_embedding(scale)
        if scale.shape[0] > length:
            scale, sin, cos = scale[-length:], sin[-length:], cos[-length:]
        if downscale:
            scale = 1 / scale
        return apply_rotary_pos_emb(x, sin, cos, scale)


class MultiheadAttention(nn.Module):
    def __init__(self, args, embed_dim, num_heads, dropout=0.0, self_attention=False,
                 encoder_decoder_attention=False, subln=False):
        super().__init__()
        self.args = args
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5

        self.self_attention = self_attention
        self.encoder_decoder_attention = encoder_decoder_attention
        self.k_proj = MultiwayWrapper(args, nn.Linear(embed_dim, embed_dim, bias=True))
        self.v_proj = MultiwayWrapper(args, nn.Linear(embed_dim, embed_dim, bias=True))
        self.q_proj = MultiwayWrapper(args, nn.Linear(embed_dim, embed_dim, bias=True))
        self.out_proj = MultiwayWrapper(args, nn.Linear(embed_dim, embed_dim, bias=True))
        self.inner_attn_ln = (
            MultiwayWrapper(args, nn.LayerNorm(self.embed_dim, eps=args.layernorm_eps))
            if subln and self.self_attention else None
        )
        self.dropout_module = nn.Dropout(dropout)
        self.xpos = (
            XPOS(self.head_dim, args.xpos_scale_base)
            if args.xpos_rel_pos and self.self_attention else None
        )

    def forward(self, query, key, value, incremental_state=None, key_padding_mask=None,
                attn_mask=None, rel_pos=None, is_first_step=False):
        bsz, tgt_len, embed_dim = query.size()
        src_len = tgt_len
        assert embed_dim == self.embed_dim
        key_bsz, src_len, _ = key.size()
        assert key_bsz == bsz

        q = self.q_proj(query)
        k = self.k_proj(key)
        v = self.v_proj(value)
        q *= self.scaling

        q = q.view(bsz, tgt_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(bsz, src_len, self.num_heads, self.head_dim).transpose(1, 2)
        v = v.view(bsz, src_len, self.num_heads, self.head_dim).transpose(1, 2)
        q = q.reshape(bsz * self.num_heads, tgt_len, self.head_dim)
        k = k.reshape(bsz * self.num_heads, src_len, self.head_dim)
        v = v.reshape(bsz * self.num_heads, src_len, self.head_dim)

        if self.xpos is not None:
            offset = 0
            k = self.xpos(k, offset=0, downscale=True)
            q = self.xpos(q, offset=offset, downscale=False)

        attn_weights = torch.bmm(q, k.transpose(1, 2))

        if attn_mask is not None:
            attn_weights = torch.nan_to_num(attn_weights)
            attn_mask = attn_mask.unsqueeze(0)
            attn_weights += attn_mask

        if key_padding_mask is not None:
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len)
            attn_weights = attn_weights.masked_fill(
                key_padding_mask.unsqueeze(1).unsqueeze(2).to(torch.bool), float("-inf")
            )
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)

        if rel_pos is not None:
            rel_pos = rel_pos.view(attn_weights.size())
            attn_weights = attn_weights + rel_pos

        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_probs = self.dropout_module(attn_weights)

        attn = torch.bmm(attn_probs, v)
        attn = attn.transpose(0, 1).reshape(tgt_len, bsz, embed_dim).transpose(0, 1)

        if self.inner_attn_ln is not None:
            attn = self.inner_attn_ln(attn)

        attn = self.out_proj(attn)
        attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len).transpose(1, 0)
        return attn, attn_weights


class CrossDecoderLayer(nn.Module):
    """The encoder-attention half of torchscale's DecoderLayer (self-attention and FFN left out)."""

    def __init__(self, args):
        super().__init__()
        self.encoder_attn = MultiheadAttention(
            args, args.decoder_embed_dim, args.decoder_attention_heads,
            self_attention=False, encoder_decoder_attention=True,
        )

    def forward(self, x, encoder_out):
        residual = x
        x, _ = self.encoder_attn(query=x, key=x, value=x, key_padding_mask=None)
        return residual + x


def make_torchscale_cross():
    torch.manual_seed(1743)
    return CrossDecoderLayer(Args()).eval()


EXPECT = {'target': 'make_torchscale_cross',
 'kind': 'cross',
 'ok': False,
 'layer': 'encoder_attn',
 'stage': 'keys',
 'mistake': 'wrong_source',
 'style': 'torchscale MultiheadAttention: one bug: the layer copies its self-attention call and '
          'passes `key=x, value=x`, so keys and values come from the decoder input and encoder_out '
          'is never read'}

"""SpeechBrain transformer (`speechbrain.lobes.models.transformer`) with attention_type="RoPEMHA":
a `TransformerEncoderLayer` (normalize_before=True, SpeechBrain's `LayerNorm` wrapper around
`nn.LayerNorm`, `PositionalwiseFeedForward`) whose `self_att` is a rotary multi-head attention with
separate q/k/v projections on a (B, T, H, D) layout, the rotation applied to even/odd feature pairs
(interleaved), an additive float `attn_mask`, and the `(output, attention)` tuple return. The stack
is used as a `TransformerEncoder` (no mask) or as a `TransformerLM` with `get_lookahead_mask`.

This file: correct (4 heads of 16, interleaved rotary base 1e4, non-causal encoder)."""

import torch
from torch import nn


def get_lookahead_mask(padded_input):
    """Additive causal mask: 0 where a key may be seen, a large negative number elsewhere."""
    seq_len = padded_input.shape[1]
    mask = (torch.triu(torch.ones((seq_len, seq_len), device=padded_input.device)) == 1).transpose(0, 1)
    return (
        mask.to(padded_input.dtype)
        .masked_fill(mask == 0, torch.finfo(padded_input.dtype).min)
        .masked_fill(mask == 1, 0.0)
    )


def _rope_rotate(x, positions, base):
    """x: (B, T, H, D); rotates the feature pairs (2i, 2i+1) by positions * base**(-2i/D)."""
    dim = x.shape[-1]
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64, device=x.device) / dim))
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    cos = angles.cos().to(x.dtype)[None, :, None, :]
    sin = angles.sin().to(x.dtype)[None, :, None, :]
    x_even, x_odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1).flatten(-2)


class RoPEMHA(nn.Module):
    def __init__(self, embed_dim, num_heads, dropout=0.0, vbias=False, vdim=None, base=10000.0):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.base = base
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(vdim or embed_dim, embed_dim, bias=vbias)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, query, key, value, attn_mask=None, key_padding_mask=None,
                return_attn_weights=True, pos_embs=None):
        bsz, tgt_len, _ = query.shape
        src_len = key.shape[1]
        q = self.q_proj(query).view(bsz, tgt_len, self.num_heads, self.head_dim)
        k = self.k_proj(key).view(bsz, src_len, self.num_heads, self.head_dim)
        v = self.v_proj(value).view(bsz, src_len, self.num_heads, self.head_dim)

        q = _rope_rotate(q, torch.arange(tgt_len, device=query.device), self.base)
        k = _rope_rotate(k, torch.arange(src_len, device=key.device), self.base)

        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scaling
        if attn_mask is not None:
            scores = scores + attn_mask
        attn = torch.softmax(scores, dim=-1)
        out = torch.matmul(attn, v)
        out = out.transpose(1, 2).reshape(bsz, tgt_len, self.embed_dim)
        out = self.out_proj(out)
        if return_attn_weights:
            return out, attn
        return out


class LayerNorm(nn.Module):
    def __init__(self, input_size, eps=1e-5):
        super().__init__()
        self.norm = nn.LayerNorm(input_size, eps=eps)

    def forward(self, x):
        return self.norm(x)


class PositionalwiseFeedForward(nn.Module):
    def __init__(self, d_ffn, input_size):
        super().__init__()
        self.ffn = nn.Sequential(nn.Linear(input_size, d_ffn), nn.ReLU(), nn.Linear(d_ffn, input_size))

    def forward(self, x):
        return self.ffn(x)


class TransformerEncoderLayer(nn.Module):
    def __init__(self, d_ffn, nhead, d_model, rope_base):
        super().__init__()
        self.self_att = RoPEMHA(d_model, nhead, base=rope_base)
        self.pos_ffn = PositionalwiseFeedForward(d_ffn, d_model)
        self.norm1 = LayerNorm(d_model, eps=1e-6)
        self.norm2 = LayerNorm(d_model, eps=1e-6)

    def forward(self, src, src_mask=None, src_key_padding_mask=None, pos_embs=None):
        src1 = self.norm1(src)
        output, self_attn = self.self_att(
            src1, src1, src1, attn_mask=src_mask, key_padding_mask=src_key_padding_mask, pos_embs=pos_embs
        )
        src = src + output
        return src + self.pos_ffn(self.norm2(src)), self_attn


class TransformerEncoder(nn.Module):
    def __init__(self, num_layers, nhead, d_ffn, d_model, rope_base):
        super().__init__()
        self.layers = nn.ModuleList(
            [TransformerEncoderLayer(d_ffn, nhead, d_model, rope_base) for _ in range(num_layers)]
        )
        self.norm = LayerNorm(d_model, eps=1e-6)

    def forward(self, src, src_mask=None):
        output = src
        for enc_layer in self.layers:
            output, _ = enc_layer(output, src_mask=src_mask)
        return self.norm(output)


class TransformerEncoderModel(nn.Module):
    causal = False

    def __init__(self):
        super().__init__()
        self.encoder = TransformerEncoder(num_layers=1, nhead=4, d_ffn=128, d_model=64, rope_base=10000.0)

    def forward(self, src):
        src_mask = get_lookahead_mask(src) if self.causal else None
        return self.encoder(src, src_mask=src_mask)


def make_speechbrain_rope():
    torch.manual_seed(2220)
    model = TransformerEncoderModel()
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {'target': 'make_speechbrain_rope',
 'kind': 'multihead',
 'ok': True,
 'layer': 'encoder.layers.0.self_att',
 'structure': {'heads': 4,
               'kv_heads': 4,
               'head_dim': 16,
               'causal': False,
               'cross': False,
               'rope': {'pairing': 'interleaved', 'fraction': 1.0, 'base': 10000},
               'qk_norm': None,
               'window': None,
               'bias': None},
 'style': 'SpeechBrain TransformerEncoderLayer with RoPEMHA (interleaved rotary, additive float '
          'mask): correct (4 heads of 16, interleaved rotary base 1e4, non-causal encoder)'}

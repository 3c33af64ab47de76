"""RiNALMo (lbcb-sci) RNA language model attention (MultiHeadSelfAttention: biased to_q/to_k/to_v, rotate_half rotary base 1e4, key-padding masked_fill(-inf), eager, out_proj).

This file: refused (a sigmoid gate projected from the layer input multiplies the merged heads before out_proj (OpenFold-style gated attention used in RNA structure heads))."""

import math

import torch
from torch import nn
from torch.nn import functional as F


class RiNALMoConfig:
    embed_dim = 64
    num_heads = 4
    rope_base = 10000
    rotary_fraction = 1.0  # packed path: fraction of each head that is rotated
    attention_type = "split"  # "split" (MultiHeadSelfAttention), "packed" (Wqkv + SDPA), "cross"
    transition_factor = 2


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class RotaryPositionEmbedding(nn.Module):
    """GPT-NeoX/ESM-2 style rotary embedding; the tables are rebuilt in float64 for every call."""

    def __init__(self, dim, base=10000):
        super().__init__()
        self.dim = dim
        self.base = base

    def _tables(self, seq_len, dtype, device):
        inv_freq = 1.0 / (
            self.base ** (torch.arange(0, self.dim, 2, dtype=torch.float64, device=device) / self.dim)
        )
        t = torch.arange(seq_len, dtype=torch.float64, device=device)
        freqs = torch.einsum("i,j->ij", t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos()[None, None].to(dtype), emb.sin()[None, None].to(dtype)

    def forward(self, q, k):
        cos, sin = self._tables(k.shape[-2], q.dtype, q.device)
        return apply_rotary_pos_emb(q, k, cos, sin)


def dot_product_attention(q, k, v, attn_mask=None, key_pad_mask=None):
    c = q.shape[-1]
    attn = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(c)

    if attn_mask is not None:
        attn = attn.masked_fill(attn_mask, float("-inf"))

    if key_pad_mask is not None:
        attn = attn.masked_fill(key_pad_mask.unsqueeze(1).unsqueeze(2), float("-inf"))

    attn = attn.softmax(dim=-1)
    output = torch.matmul(attn, v)
    return output, attn


class MultiHeadAttention(nn.Module):
    def __init__(self, c_in, num_heads, use_rot_emb=True, bias=True, rope_base=10000):
        super().__init__()
        self.c_in = c_in
        self.num_heads = num_heads
        self.c_head = c_in // num_heads
        self.c_qkv = self.c_head * num_heads
        self.use_rot_emb = use_rot_emb
        if use_rot_emb:
            self.rotary_emb = RotaryPositionEmbedding(self.c_head, base=rope_base)
        self.to_q = nn.Linear(c_in, self.c_qkv, bias=bias)
        self.to_k = nn.Linear(c_in, self.c_qkv, bias=bias)
        self.to_v = nn.Linear(c_in, self.c_qkv, bias=bias)
        self.out_proj = nn.Linear(c_in, c_in, bias=bias)
        self.to_g = nn.Linear(c_in, self.c_qkv, bias=True)

    def forward(self, q, k, v, attn_mask=None, key_pad_mask=None):
        bs = q.shape[0]
        gate = torch.sigmoid(self.to_g(q))
        q = self.to_q(q).view(bs, -1, self.num_heads, self.c_head).transpose(-2, -3)
        k = self.to_k(k).view(bs, -1, self.num_heads, self.c_head).transpose(-2, -3)
        v = self.to_v(v).view(bs, -1, self.num_heads, self.c_head).transpose(-2, -3)

        if self.use_rot_emb:
            q, k = self.rotary_emb(q, k)

        output, attn = dot_product_attention(q, k, v, attn_mask, key_pad_mask)

        output = output.transpose(-2, -3).contiguous().view(bs, -1, self.num_heads * self.c_head)
        output = output * gate
        output = self.out_proj(output)
        return output, attn


class MultiHeadSelfAttention(nn.Module):
    def __init__(self, c_in, num_heads, use_rot_emb=True, bias=True, rope_base=10000):
        super().__init__()
        self.mh_attn = MultiHeadAttention(c_in, num_heads, use_rot_emb, bias, rope_base)

    def forward(self, x, attn_mask=None, key_pad_mask=None):
        return self.mh_attn(x, x, x, attn_mask, key_pad_mask)


class PackedRotary(nn.Module):
    """flash_attn.layers.rotary.RotaryEmbedding(interleaved=False) on a packed (b, s, 3, h, d)
    tensor: only the first `dim` features of each query and key head are rotated."""

    def __init__(self, dim, base=10000.0):
        super().__init__()
        self.dim = dim
        self.base = base

    def forward(self, qkv, seqlen_offset=0):
        seqlen = qkv.shape[1]
        inv_freq = 1.0 / (
            self.base ** (torch.arange(0, self.dim, 2, dtype=torch.float64, device=qkv.device) / self.dim)
        )
        t = torch.arange(seqlen_offset, seqlen_offset + seqlen, dtype=torch.float64, device=qkv.device)
        freqs = torch.outer(t, inv_freq)
        cos = torch.cat((freqs, freqs), dim=-1).cos().to(qkv.dtype)[:, None, :]
        sin = torch.cat((freqs, freqs), dim=-1).sin().to(qkv.dtype)[:, None, :]
        q, k, v = qkv.unbind(dim=2)
        q_rot, q_pass = q[..., : self.dim], q[..., self.dim :]
        k_rot, k_pass = k[..., : self.dim], k[..., self.dim :]
        q = torch.cat((q_rot * cos + rotate_half(q_rot) * sin, q_pass), dim=-1)
        k = torch.cat((k_rot * cos + rotate_half(k_rot) * sin, k_pass), dim=-1)
        return torch.stack((q, k, v), dim=2)


class FlashMultiHeadSelfAttention(nn.Module):
    """Packed-projection self-attention; on machines without flash-attn the packed tensor goes
    through torch's scaled_dot_product_attention."""

    def __init__(self, embed_dim, num_heads, causal=False, bias=True, rotary_fraction=1.0, rope_base=10000.0):
        super().__init__()
        self.causal = causal
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.rotary_emb_dim = int(self.head_dim * rotary_fraction)
        self.rotary_emb = PackedRotary(self.rotary_emb_dim, base=rope_base)
        self.softmax_scale = self.head_dim**-0.5
        self.Wqkv = nn.Linear(embed_dim, 3 * embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)

    def forward(self, x, key_padding_mask=None):
        b, s, _ = x.shape
        qkv = self.Wqkv(x).view(b, s, 3, self.num_heads, self.head_dim)
        qkv = self.rotary_emb(qkv, seqlen_offset=0)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        attn_mask = None
        if key_padding_mask is not None:
            attn_mask = key_padding_mask[:, None, None, :]
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=self.causal, scale=self.softmax_scale
        )
        out = out.transpose(1, 2).reshape(b, s, self.embed_dim)
        return self.out_proj(out), None


class SwiGLU(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(dim, hidden)
        self.w3 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.w3(F.silu(self.w1(x)) * self.w2(x))


class TransformerBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        dim = config.embed_dim
        if config.attention_type == "packed":
            self.mh_attn = FlashMultiHeadSelfAttention(
                dim, config.num_heads, rotary_fraction=config.rotary_fraction, rope_base=config.rope_base
            )
        else:
            self.mh_attn = MultiHeadSelfAttention(dim, config.num_heads, rope_base=config.rope_base)
        self.attn_layer_norm = nn.LayerNorm(dim)
        self.transition = SwiGLU(dim, dim * config.transition_factor)
        self.out_layer_norm = nn.LayerNorm(dim)
        self.packed = config.attention_type == "packed"

    def forward(self, x, key_padding_mask=None):
        x_attn = self.attn_layer_norm(x)
        if self.packed:
            x_attn, _ = self.mh_attn(x_attn, key_padding_mask=key_padding_mask)
        else:
            pad = None if key_padding_mask is None else ~key_padding_mask
            x_attn, _ = self.mh_attn(x_attn, key_pad_mask=pad)
        x = x + x_attn
        return x + self.transition(self.out_layer_norm(x))


class Transformer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.blocks = nn.ModuleList([TransformerBlock(config)])
        self.final_layer_norm = nn.LayerNorm(config.embed_dim)

    def forward(self, x, key_padding_mask=None):
        for block in self.blocks:
            x = block(x, key_padding_mask=key_padding_mask)
        return self.final_layer_norm(x)


class RiNALMo(nn.Module):
    """Embeddings already looked up: (batch, nucleotides, embed_dim); every position is a real
    nucleotide, so the padding mask (True = keep) is all True."""

    def __init__(self, config):
        super().__init__()
        self.transformer = Transformer(config)

    def forward(self, embeddings):
        keep = torch.ones(embeddings.shape[:2], dtype=torch.bool, device=embeddings.device)
        return self.transformer(embeddings, key_padding_mask=keep)


class RNAStructureCrossBlock(nn.Module):
    """Downstream head: nucleotide embeddings attend to a conditioning sequence (e.g. an
    MSA-summary or a partner strand) through RiNALMo's MultiHeadAttention(q, k, v), no rotary."""

    def __init__(self, config):
        super().__init__()
        dim = config.embed_dim
        self.q_norm_in = nn.LayerNorm(dim)
        self.kv_norm_in = nn.LayerNorm(dim)
        self.cross_attn = MultiHeadAttention(dim, config.num_heads, use_rot_emb=False, bias=True)
        self.transition = SwiGLU(dim, dim * config.transition_factor)
        self.out_layer_norm = nn.LayerNorm(dim)

    def forward(self, x, context):
        x_in = self.q_norm_in(x)
        ctx = self.kv_norm_in(context)
        attn_out, _ = self.cross_attn(x_in, ctx, ctx)
        x = x + attn_out
        return x + self.transition(self.out_layer_norm(x))


class RNAStructureHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.blocks = nn.ModuleList([RNAStructureCrossBlock(config)])

    def forward(self, x, context):
        for block in self.blocks:
            x = block(x, context)
        return x


def make_rinalmo():
    torch.manual_seed(5304)
    config = RiNALMoConfig()
    model = RNAStructureHead(config) if config.attention_type == "cross" else RiNALMo(config)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
            elif isinstance(mod, nn.Linear) and mod.bias is not None:
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {'target': 'make_rinalmo',
 'kind': 'multihead',
 'ok': True,
 'layer': 'transformer.blocks.0.mh_attn',
 'unsupported': 'output_gate',
 'style': 'RiNALMo (lbcb-sci) RNA language model attention: refused: a sigmoid gate projected from '
          'the layer input multiplies the merged heads before out_proj (OpenFold-style gated '
          'attention used in RNA structure heads)'}

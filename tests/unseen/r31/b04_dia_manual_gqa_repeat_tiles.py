"""Nari Labs Dia (dia/layers.py): JAX-layout DenseGeneral projections (kernel (in, heads, head_dim),
torch.tensordot), Dia's RotaryEmbedding (timescale = min * (max/min)**fraction, torch.chunk halves),
torch SDPA with enable_gqa, DenseGeneral o_proj over (heads, head_dim); torch.nn.RMSNorm pre-norms.

This file: one bug: fallback for SDPA without enable_gqa expands kv heads with .repeat(1, groups, 1, 1) (tiling): query head h meets kv head h % 2."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn import RMSNorm


class DiaConfig:
    """Flattened version of Dia's ModelConfig / EncoderConfig / DecoderConfig."""

    n_embd = 64
    n_hidden = 128
    n_head = 4
    n_kv_head = 2
    head_dim = 16
    cross_query_heads = 4
    cross_head_dim = 16
    rope_min_timescale = 1
    rope_max_timescale = 10000
    normalization_layer_epsilon = 1e-5


def _normalize_axes(axes, ndim):
    return tuple(ax if ax >= 0 else ndim + ax for ax in axes)


class DenseGeneral(nn.Module):
    """Torch stand-in for flax.linen.DenseGeneral: the kernel keeps the JAX layout
    (*in_shapes, *out_features) and is contracted with torch.tensordot."""

    def __init__(self, in_shapes, out_features, axis=(-1,)):
        super().__init__()
        self.in_shapes = tuple(in_shapes)
        self.out_features = tuple(out_features)
        self.axis = tuple(axis)
        self.kernel_shape = self.in_shapes + self.out_features
        fan_in = 1
        for s in self.in_shapes:
            fan_in *= s
        self.weight = nn.Parameter(torch.randn(self.kernel_shape) / fan_in**0.5)

    def forward(self, inputs):
        norm_axis = _normalize_axes(self.axis, inputs.ndim)
        kernel_contract_axes = tuple(range(len(norm_axis)))
        return torch.tensordot(inputs, self.weight.to(inputs.dtype), dims=(norm_axis, kernel_contract_axes))


class MlpBlock(nn.Module):
    def __init__(self, embed_dim, intermediate_dim):
        super().__init__()
        self.wi_fused = DenseGeneral(in_shapes=(embed_dim,), out_features=(2, intermediate_dim), axis=(-1,))
        self.wo = DenseGeneral(in_shapes=(intermediate_dim,), out_features=(embed_dim,), axis=(-1,))

    def forward(self, x):
        fused_x = self.wi_fused(x)
        gate, up = fused_x[..., 0, :], fused_x[..., 1, :]
        return self.wo(F.silu(gate) * up)


class RotaryEmbedding(nn.Module):
    """Dia's rotary embedding: geometric timescales between min and max, the head split into two
    halves (torch.chunk) that are rotated against each other."""

    def __init__(self, embedding_dims, min_timescale=1, max_timescale=10000):
        super().__init__()
        self.embedding_dims = embedding_dims
        half_embedding_dim = embedding_dims // 2
        fraction = (2.0 * torch.arange(0, half_embedding_dim, dtype=torch.float64)) / embedding_dims
        timescale = min_timescale * (max_timescale / min_timescale) ** fraction
        self.register_buffer("timescale", timescale, persistent=False)

    def forward(self, inputs, position):
        position = position.unsqueeze(-1).unsqueeze(-1).to(torch.float64)
        sinusoid_inp = position / self.timescale
        sin = torch.sin(sinusoid_inp).to(inputs.dtype)
        cos = torch.cos(sinusoid_inp).to(inputs.dtype)
        first_half, second_half = torch.chunk(inputs, 2, dim=-1)
        first_part = first_half * cos - second_half * sin
        second_part = second_half * cos + first_half * sin
        return torch.cat((first_part, second_part), dim=-1)


class Attention(nn.Module):
    """Dia attention: DenseGeneral projections to (heads, head_dim), rotary on queries and keys at
    their own positions, torch SDPA with enable_gqa, DenseGeneral output over (heads, head_dim)."""

    def __init__(self, config, q_embed_dim, kv_embed_dim, num_query_heads, num_kv_heads, head_dim,
                 is_cross_attn=False, out_embed_dim=None):
        super().__init__()
        self.num_query_heads = num_query_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.is_cross_attn = is_cross_attn
        self.output_dim = out_embed_dim if out_embed_dim is not None else q_embed_dim
        self.projected_query_dim = num_query_heads * head_dim
        if num_query_heads % num_kv_heads != 0:
            raise ValueError("num_query_heads must be divisible by num_kv_heads")
        self.num_gqa_groups = num_query_heads // num_kv_heads

        self.q_proj = DenseGeneral(in_shapes=(q_embed_dim,), out_features=(num_query_heads, head_dim), axis=(-1,))
        self.k_proj = DenseGeneral(in_shapes=(kv_embed_dim,), out_features=(num_kv_heads, head_dim), axis=(-1,))
        self.v_proj = DenseGeneral(in_shapes=(kv_embed_dim,), out_features=(num_kv_heads, head_dim), axis=(-1,))
        self.o_proj = DenseGeneral(in_shapes=(num_query_heads, head_dim), out_features=(self.output_dim,), axis=(-2, -1))

        self.rotary_emb = RotaryEmbedding(
            embedding_dims=self.head_dim,
            min_timescale=config.rope_min_timescale,
            max_timescale=config.rope_max_timescale,
        )

    def forward(self, Xq, Xkv, q_positions, kv_positions=None, attn_mask=None, is_causal=False):
        if kv_positions is None:
            kv_positions = q_positions
        original_dtype = Xq.dtype

        Xq_BxTxNxH = self.q_proj(Xq)
        Xq_BxTxNxH = self.rotary_emb(Xq_BxTxNxH, position=q_positions)
        Xq_BxNxTxH = Xq_BxTxNxH.transpose(1, 2)

        Xk_BxSxKxH = self.k_proj(Xkv)
        Xv_BxSxKxH = self.v_proj(Xkv)
        Xk_BxSxKxH = self.rotary_emb(Xk_BxSxKxH, position=kv_positions)
        attn_k = Xk_BxSxKxH.transpose(1, 2)
        attn_v = Xv_BxSxKxH.transpose(1, 2)
        if self.num_gqa_groups > 1:
            attn_k = attn_k.repeat(1, self.num_gqa_groups, 1, 1)
            attn_v = attn_v.repeat(1, self.num_gqa_groups, 1, 1)

        attn_output = F.scaled_dot_product_attention(
            Xq_BxNxTxH,
            attn_k,
            attn_v,
            attn_mask=attn_mask if not is_causal else None,
            is_causal=is_causal,
        )

        attn_output = attn_output.transpose(1, 2).contiguous()
        output = self.o_proj(attn_output)
        return output.to(original_dtype)


class EncoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        embed_dim = config.n_embd
        self.pre_sa_norm = RMSNorm(embed_dim, eps=config.normalization_layer_epsilon)
        self.self_attention = Attention(config, embed_dim, embed_dim, config.n_head, config.n_kv_head,
                                        config.head_dim, is_cross_attn=False, out_embed_dim=embed_dim)
        self.post_sa_norm = RMSNorm(embed_dim, eps=config.normalization_layer_epsilon)
        self.mlp = MlpBlock(embed_dim, config.n_hidden)

    def forward(self, x, positions, attn_mask=None):
        residual = x
        x_norm = self.pre_sa_norm(x)
        sa_out = self.self_attention(x_norm, x_norm, q_positions=positions, attn_mask=attn_mask, is_causal=False)
        x = residual + sa_out
        residual = x
        x = residual + self.mlp(self.post_sa_norm(x))
        return x


class Encoder(nn.Module):
    """Dia's text encoder (bidirectional), fed embeddings directly."""

    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList([EncoderLayer(config)])
        self.norm = RMSNorm(config.n_embd, eps=config.normalization_layer_epsilon)

    def forward(self, x):
        B, T, _ = x.shape
        positions = torch.arange(T, device=x.device).unsqueeze(0).expand(B, T)
        for layer in self.layers:
            x = layer(x, positions)
        return self.norm(x)


class DecoderLayer(nn.Module):
    """Dia decoder layer: causal GQA self-attention, cross-attention to the encoder output, MLP.
    Unconditional decoding (encoder_out=None) skips the cross-attention sub-block."""

    def __init__(self, config):
        super().__init__()
        embed_dim = config.n_embd
        eps = config.normalization_layer_epsilon
        self.pre_sa_norm = RMSNorm(embed_dim, eps=eps)
        self.pre_ca_norm = RMSNorm(embed_dim, eps=eps)
        self.pre_mlp_norm = RMSNorm(embed_dim, eps=eps)
        self.self_attention = Attention(config, embed_dim, embed_dim, config.n_head, config.n_kv_head,
                                        config.head_dim, is_cross_attn=False, out_embed_dim=embed_dim)
        self.cross_attention = Attention(config, embed_dim, embed_dim, config.cross_query_heads,
                                         config.n_kv_head, config.cross_head_dim, is_cross_attn=True,
                                         out_embed_dim=embed_dim)
        self.mlp = MlpBlock(embed_dim, config.n_hidden)

    def forward(self, x, positions, encoder_out=None, encoder_positions=None):
        if self.use_self_attention:
            residual = x
            x_norm = self.pre_sa_norm(x)
            x = residual + self.self_attention(x_norm, x_norm, q_positions=positions, is_causal=True)
        if encoder_out is not None:
            residual = x
            x_norm = self.pre_ca_norm(x)
            ca_out = self.cross_attention(Xq=x_norm, Xkv=encoder_out, q_positions=positions,
                                          kv_positions=encoder_positions, is_causal=False)
            x = residual + ca_out
        residual = x
        return residual + self.mlp(self.pre_mlp_norm(x))

    use_self_attention = True


class Decoder(nn.Module):
    """Dia's audio decoder fed embeddings directly. text_free=True builds it for unconditional
    decoding (no encoder state: the cross-attention sub-block is not built)."""

    def __init__(self, config, text_free=False, cross_only=False):
        super().__init__()
        self.layers = nn.ModuleList([DecoderLayer(config)])
        for layer in self.layers:
            if text_free:
                del layer.cross_attention
                del layer.pre_ca_norm
            if cross_only:
                layer.use_self_attention = False
                del layer.self_attention
                del layer.pre_sa_norm
        self.norm = RMSNorm(config.n_embd, eps=config.normalization_layer_epsilon)

    def forward(self, x, encoder_out=None):
        B, T, _ = x.shape
        positions = torch.arange(T, device=x.device).unsqueeze(0).expand(B, T)
        encoder_positions = None
        if encoder_out is not None:
            S = encoder_out.shape[1]
            encoder_positions = torch.arange(S, device=x.device).unsqueeze(0).expand(B, S)
        for layer in self.layers:
            x = layer(x, positions, encoder_out=encoder_out, encoder_positions=encoder_positions)
        return self.norm(x)


class CrossAttendingDecoder(nn.Module):
    """A decoder stack whose layers only cross-attend: forward(hidden, context) with the context
    standing for the encoder output."""

    def __init__(self, config):
        super().__init__()
        self.decoder = Decoder(config, cross_only=True)

    def forward(self, hidden, context):
        return self.decoder(hidden, encoder_out=context)


def _init(model):
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, RMSNorm):
                mod.weight.uniform_(0.5, 1.5)
    return model.eval()


def make_dia_decoder():
    torch.manual_seed(3114)
    cfg = DiaConfig()
    return _init(Decoder(cfg, text_free=True))



EXPECT = {'target': 'make_dia_decoder',
 'kind': 'causal-multihead',
 'ok': False,
 'layer': 'layers.0.self_attention',
 'stage': 'scores',
 'mistake': 'kv_group_mapping',
 'style': 'Dia Attention (nari-labs/dia dia/layers.py): one bug: fallback for SDPA without '
          'enable_gqa expands kv heads with .repeat(1, groups, 1, 1) (tiling): query head h meets '
          'kv head h % 2'}

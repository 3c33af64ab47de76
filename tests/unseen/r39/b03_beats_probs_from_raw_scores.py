"""BEATs audio encoder (microsoft/unilm `beats/BEATs.py` + `beats/backbone.py`): the fairseq-derived
time-major MultiheadAttention with a bucketed, bidirectional learned relative position bias
(`relative_attention_bias = nn.Embedding(num_buckets, num_heads)`, computed by the first layer and
handed on), post-norm encoder layers (layer_norm_first = False), patch embeddings already taken.

This file: one bug: attn_probs taken from the pre-softmax scores (`attn_probs = attn_weights` placed
before the softmax), the softmax result is only returned."""

import math

import torch
import torch.nn.functional as F
from torch import nn


class BEATsConfig:
    encoder_embed_dim = 64
    encoder_ffn_embed_dim = 128
    encoder_attention_heads = 8
    encoder_layers = 1
    layer_norm_first = False
    relative_position_embedding = True
    num_buckets = 32
    max_distance = 128
    gru_rel_pos = False
    deep_norm = False
    attn_impl = "eager"  # "eager" (fairseq bmm path) or "sdpa"
    export_softmax = False


class MultiheadAttention(nn.Module):
    def __init__(
        self,
        embed_dim,
        num_heads,
        self_attention=True,
        has_relative_attention_bias=False,
        num_buckets=32,
        max_distance=128,
        gru_rel_pos=False,
        attn_impl="eager",
        export_softmax=False,
    ):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.self_attention = self_attention
        self.attn_impl = attn_impl
        self.export_softmax = export_softmax
        self.has_relative_attention_bias = has_relative_attention_bias
        self.num_buckets = num_buckets
        self.max_distance = max_distance
        if has_relative_attention_bias:
            self.relative_attention_bias = nn.Embedding(num_buckets, num_heads)
        self.scaling = self.head_dim**-0.5

        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=True)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=True)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=True)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=True)

        self.gru_rel_pos = gru_rel_pos
        if self.gru_rel_pos:
            self.grep_linear = nn.Linear(self.head_dim, 8)
            self.grep_a = nn.Parameter(torch.ones(1, num_heads, 1, 1))

    def _relative_positions_bucket(self, relative_positions, bidirectional=True):
        num_buckets = self.num_buckets
        max_distance = self.max_distance
        relative_buckets = 0
        if bidirectional:
            num_buckets = num_buckets // 2
            relative_buckets += (relative_positions > 0).to(torch.long) * num_buckets
            relative_positions = torch.abs(relative_positions)
        else:
            relative_positions = -torch.min(
                relative_positions, torch.zeros_like(relative_positions)
            )
        max_exact = num_buckets // 2
        is_small = relative_positions < max_exact
        relative_position_if_large = max_exact + (
            torch.log(relative_positions.float() / max_exact)
            / math.log(max_distance / max_exact)
            * (num_buckets - max_exact)
        ).to(torch.long)
        relative_position_if_large = torch.min(
            relative_position_if_large, torch.full_like(relative_position_if_large, num_buckets - 1)
        )
        relative_buckets += torch.where(is_small, relative_positions, relative_position_if_large)
        return relative_buckets

    def compute_bias(self, query_length, key_length):
        device = self.relative_attention_bias.weight.device
        context_position = torch.arange(query_length, dtype=torch.long, device=device)[:, None]
        memory_position = torch.arange(key_length, dtype=torch.long, device=device)[None, :]
        relative_position = memory_position - context_position
        relative_position_bucket = self._relative_positions_bucket(
            relative_position, bidirectional=True
        )
        values = self.relative_attention_bias(relative_position_bucket)
        return values.permute([2, 0, 1])  # (heads, query, key)

    def forward(self, query, key, value, key_padding_mask=None, position_bias=None):
        tgt_len, bsz, embed_dim = query.size()
        src_len = key.size(0)

        if self.has_relative_attention_bias and position_bias is None:
            position_bias = self.compute_bias(tgt_len, src_len)
            position_bias = (
                position_bias.unsqueeze(0)
                .repeat(bsz, 1, 1, 1)
                .view(bsz * self.num_heads, tgt_len, src_len)
            )

        q = self.q_proj(query)
        k = self.k_proj(key)
        v = self.v_proj(value)
        q = q * self.scaling
        alpha = 32
        q = q * (1 / alpha)

        q = q.contiguous().view(tgt_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        k = k.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        v = v.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)

        attn_mask_rel_pos = None
        if position_bias is not None:
            attn_mask_rel_pos = position_bias
            if self.gru_rel_pos:
                query_layer = query.transpose(0, 1)
                new_x_shape = query_layer.size()[:-1] + (self.num_heads, -1)
                query_layer = query_layer.view(*new_x_shape).permute(0, 2, 1, 3)
                _B, _H, _L, __ = query_layer.size()
                gate_a, gate_b = torch.sigmoid(
                    self.grep_linear(query_layer).view(_B, _H, _L, 2, 4).sum(-1, keepdim=False)
                ).chunk(2, dim=-1)
                gate_a_1 = gate_a * (gate_b * self.grep_a - 1.0) + 2.0
                attn_mask_rel_pos = gate_a_1.view(bsz * self.num_heads, tgt_len, 1) * position_bias
            attn_mask_rel_pos = attn_mask_rel_pos.view(bsz * self.num_heads, tgt_len, src_len)

        if self.attn_impl == "sdpa":
            # scores are q . k with q already scaled; undo the alpha and let SDPA apply no extra scale
            bias = attn_mask_rel_pos.view(bsz, self.num_heads, tgt_len, src_len)
            attn = F.scaled_dot_product_attention(
                (q * alpha).view(bsz, self.num_heads, tgt_len, self.head_dim),
                k.view(bsz, self.num_heads, src_len, self.head_dim),
                v.view(bsz, self.num_heads, src_len, self.head_dim),
                attn_mask=bias,
                scale=1.0,
            )
            attn = attn.reshape(bsz * self.num_heads, tgt_len, self.head_dim)
            attn_weights = None
        else:
            attn_weights = torch.bmm(q, k.transpose(1, 2))
            attn_weights = (attn_weights - attn_weights.max(dim=-1, keepdim=True)[0]) * alpha
            if attn_mask_rel_pos is not None:
                attn_weights = attn_weights + attn_mask_rel_pos
            if self.export_softmax:
                # exported graphs: plain exp / sum, kept stable by the max subtraction above
                attn_weights_float = torch.exp(attn_weights)
                attn_weights_float = attn_weights_float / attn_weights_float.sum(
                    dim=-1, keepdim=True
                )
            else:
                attn_weights_float = F.softmax(attn_weights, dim=-1)
            attn_probs = attn_weights
            attn_weights = attn_weights_float.type_as(attn_weights)
            attn = torch.bmm(attn_probs, v)

        attn = attn.transpose(0, 1).contiguous().view(tgt_len, bsz, embed_dim)
        attn = self.out_proj(attn)
        return attn, attn_weights, position_bias


class TransformerSentenceEncoderLayer(nn.Module):
    def __init__(self, cfg, has_relative_attention_bias):
        super().__init__()
        self.self_attn = MultiheadAttention(
            cfg.encoder_embed_dim,
            cfg.encoder_attention_heads,
            self_attention=True,
            has_relative_attention_bias=has_relative_attention_bias,
            num_buckets=cfg.num_buckets,
            max_distance=cfg.max_distance,
            gru_rel_pos=cfg.gru_rel_pos,
            attn_impl=cfg.attn_impl,
            export_softmax=cfg.export_softmax,
        )
        self.self_attn_layer_norm = nn.LayerNorm(cfg.encoder_embed_dim)
        self.fc1 = nn.Linear(cfg.encoder_embed_dim, cfg.encoder_ffn_embed_dim)
        self.fc2 = nn.Linear(cfg.encoder_ffn_embed_dim, cfg.encoder_embed_dim)
        self.final_layer_norm = nn.LayerNorm(cfg.encoder_embed_dim)

    def forward(self, x, self_attn_padding_mask=None, pos_bias=None):
        residual = x
        x, attn, pos_bias = self.self_attn(
            query=x, key=x, value=x, key_padding_mask=self_attn_padding_mask, position_bias=pos_bias
        )
        x = self.self_attn_layer_norm(residual + x)
        residual = x
        x = self.fc2(F.gelu(self.fc1(x)))
        x = self.final_layer_norm(residual + x)
        return x, attn, pos_bias


class TransformerEncoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.layers = nn.ModuleList(
            [
                TransformerSentenceEncoderLayer(cfg, has_relative_attention_bias=(i == 0))
                for i in range(cfg.encoder_layers)
            ]
        )
        self.layer_norm = nn.LayerNorm(cfg.encoder_embed_dim)

    def forward(self, x, padding_mask=None):
        x = self.layer_norm(x)
        x = x.transpose(0, 1)  # B x T x C -> T x B x C
        pos_bias = None
        for layer in self.layers:
            x, _, pos_bias = layer(x, self_attn_padding_mask=padding_mask, pos_bias=pos_bias)
        return x.transpose(0, 1)


class BEATsBackbone(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.encoder = TransformerEncoder(cfg)

    def forward(self, patch_features):
        return self.encoder(patch_features)


def make_beats_encoder():
    torch.manual_seed(3902)
    model = BEATsBackbone(BEATsConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
            elif isinstance(mod, nn.Linear) and mod.bias is not None:
                mod.bias.uniform_(-0.2, 0.2)
            elif isinstance(mod, nn.Embedding):
                mod.weight.normal_(0.0, 0.5)
            elif isinstance(mod, MultiheadAttention) and mod.gru_rel_pos:
                mod.grep_a.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {
    "target": "make_beats_encoder",
    "kind": "multihead",
    "ok": False,
    "layer": "encoder.layers.0.self_attn",
    "stage": "weights",
    "mistake": "not_softmax",
    "style": "BEATs MultiheadAttention (microsoft/unilm beats, bucketed learned relative bias) (base "
    "c02): one bug: attn_probs taken from the pre-softmax scores (`attn_probs = "
    "attn_weights` placed before the softmax), the softmax result is only returned",
}

"""MB-STR sequential recommender encoder (huawei-noah/benchmark FuxiCTR model_zoo, BERT4Rec-style MultiHeadedAttention with linear_layers/output_linear) with a T5-style bucketed RelativePositionBias (nn.Embedding(num_buckets, heads)) added to the scores; bidirectional, model-built padding mask.

This file: (base c06) refused: MB-STR's multi-behaviour attention: each token's q/k/v projected with the weights of its behaviour type (click/cart/buy cycling by position), a per-token choice of projection."""

import math

import torch
import torch.nn.functional as F
from torch import nn


class MBSTRConfig:
    hidden_units = 64
    num_heads = 4
    num_buckets = 32
    max_distance = 128
    attn_impl = "eager"  # "eager" or "sdpa"


class RelativePositionBias(nn.Module):
    """T5-style bucketed relative position bias, one learned scalar per (bucket, head)."""

    def __init__(self, num_buckets=32, max_distance=128, n_heads=2):
        super().__init__()
        self.num_buckets = num_buckets
        self.max_distance = max_distance
        self.relative_attention_bias = nn.Embedding(self.num_buckets, n_heads)

    @staticmethod
    def _relative_position_bucket(relative_position, num_buckets=32, max_distance=128):
        n = -relative_position
        num_buckets //= 2
        ret = (n < 0).to(torch.long) * num_buckets
        n = torch.abs(n)
        max_exact = num_buckets // 2
        is_small = n < max_exact
        val_if_large = (
            max_exact
            + (
                torch.log(n.double().clamp(min=1) / max_exact)
                / math.log(max_distance / max_exact)
                * (num_buckets - max_exact)
            ).long()
        )
        val_if_large = torch.clamp(val_if_large, max=num_buckets - 1)
        return ret + torch.where(is_small, n, val_if_large)

    def forward(self, qlen, klen):
        device = self.relative_attention_bias.weight.device
        q_pos = torch.arange(qlen, dtype=torch.long, device=device)
        k_pos = torch.arange(klen, dtype=torch.long, device=device)
        relative_position = k_pos[None, :] - q_pos[:, None]
        rp_bucket = self._relative_position_bucket(
            relative_position, num_buckets=self.num_buckets, max_distance=self.max_distance
        )
        values = self.relative_attention_bias(rp_bucket)  # (qlen, klen, heads)
        return values.permute(2, 0, 1).unsqueeze(0)  # (1, heads, qlen, klen)


class Attention(nn.Module):
    """Scaled dot product attention with an additive position bias."""

    def forward(self, query, key, value, mask=None, rel_bias=None):
        scores = torch.matmul(query, key.transpose(-2, -1)) / math.sqrt(query.size(-1))
        if rel_bias is not None:
            scores = scores + rel_bias
        if mask is not None:
            scores = scores.masked_fill(mask == 0, -1e9)
        p_attn = F.softmax(scores, dim=-1)
        return torch.matmul(p_attn, value), p_attn


class MultiHeadedAttention(nn.Module):
    def __init__(self, h, d_model, attn_impl="eager"):
        super().__init__()
        assert d_model % h == 0
        self.d_k = d_model // h
        self.h = h
        self.attn_impl = attn_impl
        self.linear_layers = nn.ModuleList([nn.Linear(d_model, d_model) for _ in range(3)])
        self.output_linear = nn.Linear(d_model, d_model)
        self.behavior_layers = nn.ModuleList(
            [nn.ModuleList([nn.Linear(d_model, d_model) for _ in range(3)]) for _ in range(2)]
        )
        self.attention = Attention()

    def forward(self, query, key, value, mask=None, rel_bias=None):
        batch_size = query.size(0)
        behavior = torch.arange(query.size(1), device=query.device) % 3  # 0 click, 1 cart, 2 buy
        projected = []
        for i, x in enumerate((query, key, value)):
            options = [self.linear_layers[i](x)] + [blk[i](x) for blk in self.behavior_layers]
            y = torch.stack(options, dim=0)[behavior, :, torch.arange(x.size(1))].transpose(0, 1)
            projected.append(y.view(batch_size, -1, self.h, self.d_k).transpose(1, 2))
        query, key, value = projected
        if self.attn_impl == "sdpa":
            attn_mask = rel_bias
            if mask is not None:
                attn_mask = attn_mask.masked_fill(mask == 0, -1e9)
            x = F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask)
        else:
            x, _ = self.attention(query, key, value, mask=mask, rel_bias=rel_bias)
        x = x.transpose(1, 2).contiguous().view(batch_size, -1, self.h * self.d_k)
        return self.output_linear(x)


class SublayerConnection(nn.Module):
    def __init__(self, size):
        super().__init__()
        self.norm = nn.LayerNorm(size)

    def forward(self, x, sublayer):
        return x + sublayer(self.norm(x))


class PositionwiseFeedForward(nn.Module):
    def __init__(self, d_model, d_ff):
        super().__init__()
        self.w_1 = nn.Linear(d_model, d_ff)
        self.w_2 = nn.Linear(d_ff, d_model)

    def forward(self, x):
        return self.w_2(F.gelu(self.w_1(x)))


class TransformerBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention = MultiHeadedAttention(
            config.num_heads, config.hidden_units, config.attn_impl
        )
        self.feed_forward = PositionwiseFeedForward(config.hidden_units, 4 * config.hidden_units)
        self.input_sublayer = SublayerConnection(config.hidden_units)
        self.output_sublayer = SublayerConnection(config.hidden_units)

    def forward(self, x, mask, rel_bias):
        x = self.input_sublayer(
            x, lambda _x: self.attention(_x, _x, _x, mask=mask, rel_bias=rel_bias)
        )
        return self.output_sublayer(x, self.feed_forward)


class MBSTREncoder(nn.Module):
    """Bidirectional (BERT4Rec-style) sequence encoder over item embeddings: the model builds the
    padding mask from the valid positions and one relative position bias shared by every block."""

    def __init__(self, config):
        super().__init__()
        self.rel_pos_bias = RelativePositionBias(
            config.num_buckets, config.max_distance, config.num_heads
        )
        self.transformer_blocks = nn.ModuleList([TransformerBlock(config)])
        self.norm = nn.LayerNorm(config.hidden_units)

    def forward(self, item_emb):
        b, n, _ = item_emb.shape
        valid = torch.ones(b, n, dtype=torch.bool, device=item_emb.device)  # no padding here
        mask = valid.unsqueeze(1).repeat(1, n, 1).unsqueeze(1)  # (b, 1, n, n)
        rel_bias = self.rel_pos_bias(n, n).to(item_emb.dtype)
        x = item_emb
        for block in self.transformer_blocks:
            x = block(x, mask, rel_bias)
        return self.norm(x)


def make_mbstr_encoder():
    torch.manual_seed(4006)
    model = MBSTREncoder(MBSTRConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
            elif isinstance(mod, nn.Linear):
                mod.bias.uniform_(-0.2, 0.2)
        model.rel_pos_bias.relative_attention_bias.weight.normal_(0.0, 0.8)
    return model.eval()


EXPECT = {
    "target": "make_mbstr_encoder",
    "kind": "multihead",
    "ok": True,
    "layer": "transformer_blocks.0.attention",
    "unsupported": "behavior_specific_projections",
    "style": "MB-STR (r04_mbstr_behavior_specific_qkv): (base c06) refused: MB-STR's multi-behaviour "
    "attention: each token's q/k/v projected with the weights of its behaviour type "
    "(click/cart/buy cycling by position), a per-token choice of projection",
}

"""facebookresearch/metaseq OPT (TransformerDecoder + ModelParallelMultiheadAttention) without
model parallelism, in plain torch.

TransformerLanguageModel: `decoder` with `embed_tokens`, `embed_positions` (LearnedPositionalEmbedding,
padding_idx 1, positions start at padding_idx + 1 = 2), `layers.N` (ModelParallelTransformerDecoderLayer,
pre-norm: `self_attn_layer_norm`, `self_attn`, `final_layer_norm`, `fc1`/`fc2` ReLU), `layer_norm`,
`output_projection`.  Activations are time-first (T, B, C) inside the decoder as in fairseq/metaseq.
ModelParallelMultiheadAttention: one fused `qkv_proj` (bias) chunked q | k | v, `q *= self.scaling`,
(B * H, T, d) bmm, additive future mask (-inf above the diagonal), softmax in float32, `out_proj`.
Slip: layer 1 is the `MegatronStyle` attention variant whose fused kernel path also multiplies the
bmm result by `self.scaling` (the kernel expected unscaled q), so that layer's scores are scaled by
1/head_dim.  No cache.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["decoder.layers.0.self_attn", "decoder.layers.1.self_attn", "decoder.layers.2.self_attn"],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "decoder.layers.1.self_attn",
    "stage": "scaled_scores",
    "mistake": "wrong_scale",
    "style": "metaseq OPT: time-first (T, B, C), fused qkv_proj chunked, q *= scaling, (B*H) bmm, -inf future mask, "
    "offset-2 learned positions, pre-norm ReLU FFN; layer 1 multiplies the scores by scaling a second time",
}


class LearnedPositionalEmbedding(nn.Embedding):
    def __init__(self, num_embeddings, embedding_dim, padding_idx):
        super().__init__(num_embeddings + padding_idx + 1, embedding_dim, padding_idx)

    def forward(self, tokens):
        mask = tokens.ne(self.padding_idx).int()
        positions = (torch.cumsum(mask, dim=1) * mask).long() + self.padding_idx
        return F.embedding(positions, self.weight, self.padding_idx)


class ModelParallelMultiheadAttention(nn.Module):
    rescale_after_bmm = False

    def __init__(self, embed_dim, num_heads):
        super().__init__()
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(embed_dim, 3 * embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, query, attn_mask):
        tgt_len, bsz, embed_dim = query.size()
        q, k, v = self.qkv_proj(query).chunk(3, dim=-1)
        q = q * self.scaling
        q = q.contiguous().view(tgt_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        k = k.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        v = v.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        attn_weights = torch.bmm(q, k.transpose(1, 2))
        if self.rescale_after_bmm:
            attn_weights = attn_weights * self.scaling
        attn_weights = attn_weights + attn_mask.unsqueeze(0)
        attn_probs = F.softmax(attn_weights.float(), dim=-1).type_as(attn_weights)
        attn = torch.bmm(attn_probs, v)
        attn = attn.transpose(0, 1).contiguous().view(tgt_len, bsz, embed_dim)
        return self.out_proj(attn)


class MegatronStyleMultiheadAttention(ModelParallelMultiheadAttention):
    rescale_after_bmm = True


class ModelParallelTransformerDecoderLayer(nn.Module):
    def __init__(self, args, attn_cls):
        super().__init__()
        self.self_attn = attn_cls(args.decoder_embed_dim, args.decoder_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(args.decoder_embed_dim)
        self.fc1 = nn.Linear(args.decoder_embed_dim, args.decoder_ffn_embed_dim)
        self.fc2 = nn.Linear(args.decoder_ffn_embed_dim, args.decoder_embed_dim)
        self.final_layer_norm = nn.LayerNorm(args.decoder_embed_dim)

    def forward(self, x, self_attn_mask):
        x = x + self.self_attn(self.self_attn_layer_norm(x), self_attn_mask)
        return x + self.fc2(F.relu(self.fc1(self.final_layer_norm(x))))


class TransformerDecoder(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.embed_scale = 1.0
        self.embed_tokens = nn.Embedding(args.vocab_size, args.decoder_embed_dim, padding_idx=1)
        self.embed_positions = LearnedPositionalEmbedding(args.max_target_positions, args.decoder_embed_dim, 1)
        self.layers = nn.ModuleList([
            ModelParallelTransformerDecoderLayer(
                args, MegatronStyleMultiheadAttention if i in args.megatron_style_layers else ModelParallelMultiheadAttention)
            for i in range(args.decoder_layers)
        ])
        self.layer_norm = nn.LayerNorm(args.decoder_embed_dim)
        self.output_projection = nn.Linear(args.decoder_embed_dim, args.vocab_size, bias=False)

    def buffered_future_mask(self, tensor):
        dim = tensor.size(0)
        return torch.triu(torch.full((dim, dim), float("-inf"), dtype=tensor.dtype, device=tensor.device), 1)

    def forward(self, prev_output_tokens):
        x = self.embed_scale * self.embed_tokens(prev_output_tokens) + self.embed_positions(prev_output_tokens)
        x = x.transpose(0, 1)
        mask = self.buffered_future_mask(x)
        for layer in self.layers:
            x = layer(x, mask)
        x = self.layer_norm(x).transpose(0, 1)
        return self.output_projection(x)


class TransformerLanguageModel(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.decoder = TransformerDecoder(args)

    def forward(self, src_tokens):
        return self.decoder(src_tokens)


def make_model():
    torch.manual_seed(2008)
    args = SimpleNamespace(vocab_size=96, decoder_embed_dim=64, decoder_ffn_embed_dim=128, decoder_layers=3,
                           decoder_attention_heads=4, max_target_positions=64, megatron_style_layers=(1,))
    model = TransformerLanguageModel(args)
    g = torch.Generator().manual_seed(20081)
    with torch.no_grad():
        model.decoder.embed_positions.weight.normal_(0.0, 0.5, generator=g)
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model.eval()

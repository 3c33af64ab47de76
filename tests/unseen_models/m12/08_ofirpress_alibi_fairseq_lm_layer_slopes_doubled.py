"""ALiBi as in ofirpress/attention_with_linear_biases (a fairseq fork): transformer_lm decoder.

TransformerLanguageModel -> decoder (TransformerDecoder: embed_tokens * embed_scale, no position
embeddings at all, layers.N, layer_norm, output_projection).  TransformerDecoderLayer is pre-norm
(decoder_normalize_before): self_attn_layer_norm -> self_attn -> residual, final_layer_norm -> fc1/relu/
fc2 -> residual.  fairseq MultiheadAttention: q_proj/k_proj/v_proj/out_proj with bias, time-first
(tgt, bsz, embed) input, q * scaling, (bsz * heads, tgt, src) bmm, then `attn_mask` added.  The
decoder's `buffered_future_mask` is the ALiBi repo's: -inf above the diagonal plus, per head,
slope * key_position (the softmax-equivalent form of -slope * (i - j)), slopes from `get_slopes(n)`
(geometric, start 2^(-8/n)); 4 heads, so 1/4, 1/16, 1/64, 1/256.
Slip: layer 1 was configured with `alibi_heads_override=8` from a wider sibling model, so its future
mask is built with `get_slopes(8)[:4]` = 1/2, 1/4, 1/8, 1/16: not the geometric sequence for 4 heads.
No cache.
"""

import math

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
    "stage": "biased_scores",
    "mistake": "bias_slopes",
    "style": "ofirpress ALiBi fairseq fork: time-first fairseq MultiheadAttention (bsz*heads bmm), no positions, "
    "buffered_future_mask = -inf triu + slope * key position; layer 1 uses get_slopes(8)[:4]",
}


def get_slopes(n):
    def get_slopes_power_of_2(n):
        start = 2 ** (-2 ** -(math.log2(n) - 3))
        ratio = start
        return [start * ratio ** i for i in range(n)]

    if math.log2(n).is_integer():
        return get_slopes_power_of_2(n)
    closest = 2 ** math.floor(math.log2(n))
    return get_slopes_power_of_2(closest) + get_slopes(2 * closest)[0::2][: n - closest]


class MultiheadAttention(nn.Module):
    def __init__(self, embed_dim, num_heads):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, query, key, value, attn_mask=None):
        tgt_len, bsz, embed_dim = query.size()
        q = self.q_proj(query) * self.scaling
        k = self.k_proj(key)
        v = self.v_proj(value)
        q = q.contiguous().view(tgt_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        k = k.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        v = v.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        attn_weights = torch.bmm(q, k.transpose(1, 2))
        if attn_mask is not None:
            attn_weights = attn_weights + attn_mask.repeat(bsz, 1, 1)
        attn_probs = F.softmax(attn_weights, dim=-1)
        attn = torch.bmm(attn_probs, v)
        attn = attn.transpose(0, 1).contiguous().view(tgt_len, bsz, embed_dim)
        return self.out_proj(attn), None


class TransformerDecoderLayer(nn.Module):
    def __init__(self, args, alibi_heads):
        super().__init__()
        self.alibi_heads = alibi_heads
        self.self_attn = MultiheadAttention(args.decoder_embed_dim, args.decoder_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(args.decoder_embed_dim)
        self.fc1 = nn.Linear(args.decoder_embed_dim, args.decoder_ffn_embed_dim)
        self.fc2 = nn.Linear(args.decoder_ffn_embed_dim, args.decoder_embed_dim)
        self.final_layer_norm = nn.LayerNorm(args.decoder_embed_dim)

    def forward(self, x, self_attn_mask):
        residual = x
        x = self.self_attn_layer_norm(x)
        x, _ = self.self_attn(query=x, key=x, value=x, attn_mask=self_attn_mask)
        x = residual + x
        residual = x
        x = self.fc2(F.relu(self.fc1(self.final_layer_norm(x))))
        return residual + x


class TransformerDecoder(nn.Module):
    def __init__(self, args, dictionary_size):
        super().__init__()
        self.num_heads = args.decoder_attention_heads
        self.embed_scale = math.sqrt(args.decoder_embed_dim)
        self.embed_tokens = nn.Embedding(dictionary_size, args.decoder_embed_dim, padding_idx=1)
        overrides = getattr(args, "alibi_heads_override", {})
        self.layers = nn.ModuleList([
            TransformerDecoderLayer(args, overrides.get(i, self.num_heads)) for i in range(args.decoder_layers)])
        self.layer_norm = nn.LayerNorm(args.decoder_embed_dim)
        self.output_projection = nn.Linear(args.decoder_embed_dim, dictionary_size, bias=False)

    def buffered_future_mask(self, tensor, alibi_heads):
        dim = tensor.size(0)
        slopes = torch.tensor(get_slopes(alibi_heads), dtype=tensor.dtype)[: self.num_heads]
        alibi = slopes[:, None, None] * torch.arange(dim, dtype=tensor.dtype)[None, None, :].expand(
            self.num_heads, dim, dim)
        future = torch.triu(torch.full((dim, dim), float("-inf"), dtype=tensor.dtype), 1)
        return future[None] + alibi

    def forward(self, prev_output_tokens):
        x = self.embed_scale * self.embed_tokens(prev_output_tokens)
        x = x.transpose(0, 1)
        for layer in self.layers:
            x = layer(x, self.buffered_future_mask(x, layer.alibi_heads))
        x = self.layer_norm(x).transpose(0, 1)
        return self.output_projection(x)


class TransformerLanguageModel(nn.Module):
    def __init__(self, args, vocab):
        super().__init__()
        self.decoder = TransformerDecoder(args, vocab)

    def forward(self, src_tokens):
        return self.decoder(src_tokens)


class Args:
    decoder_embed_dim = 64
    decoder_ffn_embed_dim = 128
    decoder_layers = 3
    decoder_attention_heads = 4
    alibi_heads_override = {1: 8}


def make_model():
    torch.manual_seed(1208)
    model = TransformerLanguageModel(Args(), 100)
    g = torch.Generator().manual_seed(12081)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
            if isinstance(m, nn.Embedding):
                m.weight.mul_(0.125)
    return model.eval()

"""VoiceCraft's decoder (jasonppy/VoiceCraft, models/voicecraft.py + modules/transformer.py,
activation.py) as a
token LM on a single codebook.

VoiceCraft: audio_embedding.0 (TokenEmbedding.word_embeddings), audio_positional_embedding
(SinePositionalEmbedding: x * x_scale + alpha * pe, pe[:, 0::2] = sin, pe[:, 1::2] = cos, built
in float64
at call time, alpha learnable = 0.8, offset by the cached length), decoder = TransformerEncoder
(layers.N = norm_first TransformerEncoderLayer: norm1 -> self_attn, norm2 ->
linear1/gelu/linear2; final
norm), predict_layer.0 (Linear, GELU, Linear).  MultiheadAttention keeps
torch.nn.MultiheadAttention's
parameters (packed in_proj_weight / in_proj_bias split by unflatten(-1, (3, E)), out_proj),
works
time-first: q/k/v viewed (T, B*H, D) and transposed, q * sqrt(1/D), baddbmm over a float mask
made from
the bool mask (True -> -inf), softmax, bmm, heads merged with transpose(0, 1).view(T*B, E),
out_proj.
MHA 4/4, width 64.
Cache: hf.  `out = model(ids, use_cache=True)` starts from VoiceCraft's empty-past sentinel
(torch.ones(layers, 2, B): ndim <= 2 means nothing cached) and returns `out.past_key_values` =
one tensor
(layers, 2, B, H, T, D); pass it back; each layer concatenates its past on the time axis and
returns the
stacked present.  Logits in `out.logits`.
Correct."""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": [
        "decoder.layers.0.self_attn",
        "decoder.layers.1.self_attn",
        "decoder.layers.2.self_attn",
    ],
    "kind": "causal-multihead",
    "cache": "hf",
    "style": "jasonppy/VoiceCraft (VALL-E lineage) decoder: TokenEmbedding + "
    "SinePositionalEmbedding (sin even / cos odd features, learnable alpha), norm_first "
    "TransformerEncoderLayer, torch-MHA-layout attention with packed in_proj_weight, "
    "(B*H, T, D) bmm, q * sqrt(1/D), baddbmm with a -inf float mask, `past` tensor "
    "(layers, 2, B, H, T, D) with the ndim<=2 empty-past sentinel, present stacked per "
    "layer",
}


class TokenEmbedding(nn.Module):
    def __init__(self, dim_model, vocab_size):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab_size, dim_model)

    def forward(self, x):
        return self.word_embeddings(x)


class SinePositionalEmbedding(nn.Module):
    """VALL-E / VoiceCraft style: x * x_scale + alpha * pe; sin on even, cos on odd features."""

    def __init__(self, dim_model, scale=False, alpha=False):
        super().__init__()
        self.dim_model = dim_model
        self.x_scale = math.sqrt(dim_model) if scale else 1.0
        self.alpha = nn.Parameter(torch.ones(1), requires_grad=alpha)

    def extend_pe(self, length, dtype, device):
        pe = torch.zeros(length, self.dim_model, dtype=torch.float64)
        position = torch.arange(0, length, dtype=torch.float64).unsqueeze(1)
        div_term = torch.exp(
            torch.arange(0, self.dim_model, 2, dtype=torch.float64)
            * -(math.log(10000.0) / self.dim_model)
        )
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        return pe.unsqueeze(0).to(dtype=dtype, device=device)

    def forward(self, x, offset=0):
        pe = self.extend_pe(offset + x.size(1), x.dtype, x.device)
        return x * self.x_scale + self.alpha * pe[:, offset : offset + x.size(1)]


class MultiheadAttention(nn.Module):
    """torch.nn.MultiheadAttention layout (packed in_proj_weight) plus VoiceCraft's `past`."""

    def __init__(self, embed_dim, num_heads):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.batch_first = True
        self.in_proj_weight = nn.Parameter(
            torch.randn(3 * embed_dim, embed_dim) / math.sqrt(embed_dim)
        )
        self.in_proj_bias = nn.Parameter(0.02 * torch.randn(3 * embed_dim))
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def _in_projection_packed(self, x):
        proj = F.linear(x, self.in_proj_weight, self.in_proj_bias)
        proj = (
            proj.unflatten(-1, (3, self.embed_dim))
            .unsqueeze(0)
            .transpose(0, -2)
            .squeeze(-2)
            .contiguous()
        )
        return proj[0], proj[1], proj[2]

    def forward(self, query, attn_mask=None, past=None):
        query = query.transpose(0, 1)  # (T, B, E)
        tgt_len, bsz, embed_dim = query.shape
        h, d = self.num_heads, self.head_dim
        q, k, v = self._in_projection_packed(query)
        q = q.view(tgt_len, bsz * h, d).transpose(0, 1)
        k = k.view(k.shape[0], bsz * h, d).transpose(0, 1)
        v = v.view(v.shape[0], bsz * h, d).transpose(0, 1)
        if past is not None and past.ndim > 2:
            pk, pv = past[0], past[1]  # (B, H, P, D)
            k = torch.cat([pk.reshape(bsz * h, -1, d), k], dim=1)
            v = torch.cat([pv.reshape(bsz * h, -1, d), v], dim=1)
        present = torch.stack([k.view(bsz, h, -1, d), v.view(bsz, h, -1, d)], dim=0)
        src_len = k.shape[1]
        mask = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device).masked_fill_(
            attn_mask, float("-inf")
        )
        q_scaled = q * math.sqrt(1.0 / float(d))
        attn_output_weights = torch.baddbmm(
            mask.view(1, tgt_len, src_len), q_scaled, k.transpose(-2, -1)
        )
        attn_output_weights = F.softmax(attn_output_weights, dim=-1)
        attn_output = torch.bmm(attn_output_weights, v)
        attn_output = attn_output.transpose(0, 1).contiguous().view(tgt_len * bsz, embed_dim)
        attn_output = self.out_proj(attn_output).view(tgt_len, bsz, embed_dim)
        return attn_output.transpose(0, 1), present


ATTN_CLASSES = {"mha": MultiheadAttention}


class TransformerEncoderLayer(nn.Module):
    def __init__(self, config, attn_cls):
        super().__init__()
        self.self_attn = attn_cls(config.d_model, config.nhead)
        self.linear1 = nn.Linear(config.d_model, config.dim_feedforward)
        self.linear2 = nn.Linear(config.dim_feedforward, config.d_model)
        self.norm_first = True
        self.norm1 = nn.LayerNorm(config.d_model)
        self.norm2 = nn.LayerNorm(config.d_model)

    def forward(self, src, src_mask=None, past=None):
        x = src
        attn_out, present = self.self_attn(self.norm1(x), attn_mask=src_mask, past=past)
        x = x + attn_out
        x = x + self.linear2(F.gelu(self.linear1(self.norm2(x))))
        return x, present


class TransformerEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList(
            [TransformerEncoderLayer(config, ATTN_CLASSES[a]) for a in config.attn_impl]
        )
        self.num_layers = len(self.layers)
        self.norm = nn.LayerNorm(config.d_model)

    def forward(self, src, mask=None, past=None):
        output = src
        new_present = []
        for n_layer, mod in enumerate(self.layers):
            output, present = mod(
                output, src_mask=mask, past=None if past is None else past[n_layer]
            )
            new_present.append(present)
        return self.norm(output), torch.stack(new_present, dim=0)


class VoiceCraft(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.audio_embedding = nn.ModuleList(
            [TokenEmbedding(config.d_model, config.audio_vocab_size)]
        )
        self.audio_positional_embedding = SinePositionalEmbedding(
            config.d_model, scale=False, alpha=True
        )
        self.decoder = TransformerEncoder(config)
        self.predict_layer = nn.ModuleList(
            [
                nn.Sequential(
                    nn.Linear(config.d_model, config.audio_vocab_size // 2),
                    nn.GELU(),
                    nn.Linear(config.audio_vocab_size // 2, config.audio_vocab_size),
                )
            ]
        )

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        bsz, y_len = input_ids.shape
        past = past_key_values
        if use_cache and past is None:
            # VoiceCraft's empty-past sentinel: ndim <= 2 means "nothing cached yet, return present"
            past = torch.ones(self.decoder.num_layers, 2, bsz, device=input_ids.device)
        past_len = past.shape[-2] if (past is not None and past.ndim > 3) else 0
        if past_len + y_len > self.config.max_len:
            raise ValueError("sequence longer than max_len")
        y_emb = self.audio_embedding[0](input_ids)
        y_input = self.audio_positional_embedding(y_emb, offset=past_len)
        y_attn_mask = torch.triu(
            torch.ones(y_len, y_len, dtype=torch.bool, device=input_ids.device), diagonal=1
        )
        if past_len:
            y_attn_mask = torch.cat(
                [
                    torch.zeros(y_len, past_len, dtype=torch.bool, device=input_ids.device),
                    y_attn_mask,
                ],
                dim=1,
            )
        out, present = self.decoder(y_input, mask=y_attn_mask, past=past)
        logits = self.predict_layer[0](out)
        return SimpleNamespace(logits=logits, past_key_values=present if use_cache else None)


def make_model():
    torch.manual_seed(2904)
    config = SimpleNamespace(
        d_model=64,
        nhead=4,
        dim_feedforward=128,
        audio_vocab_size=96,
        max_len=64,
        attn_impl=["mha", "mha", "mha"],
    )
    model = VoiceCraft(config)
    g = torch.Generator().manual_seed(29041)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
        model.audio_positional_embedding.alpha.fill_(0.8)
    return model.eval()

"""microsoft/torchscale Decoder (torchscale/architecture/decoder.py + component/multihead_attention.py)
as a decoder-only LM, with subln, xpos, MoE, deepnorm and relative position bias all off.

Decoder: embed_tokens, embed_scale sqrt(d), embed_positions (PositionalEmbedding: learned, positions
0..n-1 offset by the cached length), layernorm_embedding, layers.N (DecoderLayer, pre-norm:
self_attn_layer_norm -> self_attn -> + residual; final_layer_norm -> ffn (FeedForwardNetwork fc1, gelu,
fc2) -> + residual), layer_norm, output_projection.  MultiheadAttention: k_proj/v_proj/q_proj/out_proj
with bias, q *= scaling (head_dim^-0.5), heads folded to (bsz * num_heads, len, head_dim), incremental
state per layer holding prev_key/prev_value (bsz * heads, len, d) concatenated on dim 1, bmm scores +
additive -inf triu mask (no mask on one-token steps), softmax in float32, bmm with values.  MHA 4x16.
Cache: hf mechanics with torchscale's incremental_state: `out = model(ids, use_cache=True)`, then
`model(tok, past_key_values=out.past_key_values, use_cache=True)`; past_key_values is the dict of
per-layer {"prev_key", "prev_value"}; logits in `out.logits`.
Slip: the one-token path goes through a "shared prompt" shortcut written for sampling several
continuations of one prompt: it reads the cached keys/values of the first sequence only
(`prev_key[: self.num_heads]`) and repeats them for the whole batch.  With one sequence, or identical
prompts, decoding is exact; with a batch of different prompts every sequence after the first attends
to the first sequence's cache from step 0 (cache_other).
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
    "cache": "hf",
    "decode": {"mistake": "cache_other", "step": 0, "layer": "decoder.layers.0.self_attn"},
    "style": "torchscale Decoder (subln/xpos/MoE off): embed_scale, learned PositionalEmbedding, layernorm_embedding, "
    "pre-norm, (bsz*heads) bmm with q*scaling, incremental_state prev_key/prev_value; the one-token path reuses "
    "sequence 0's cache for the whole batch (shared-prompt shortcut)",
}


class PositionalEmbedding(nn.Embedding):
    def forward(self, x, incremental_state=None, past_len=0):
        positions = torch.arange(past_len, past_len + x.size(1), device=x.device).unsqueeze(0)
        return F.embedding(positions, self.weight)


class MultiheadAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, layer_idx):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim**-0.5
        self.layer_idx = layer_idx
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=True)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=True)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=True)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=True)
        self.inner_attn_ln = None

    def forward(self, query, key, value, incremental_state=None, attn_mask=None):
        bsz, tgt_len, embed_dim = query.size()
        q = self.q_proj(query) * self.scaling
        k = self.k_proj(key)
        v = self.v_proj(value)
        q = q.view(bsz, tgt_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(bsz, -1, self.num_heads, self.head_dim).transpose(1, 2)
        v = v.view(bsz, -1, self.num_heads, self.head_dim).transpose(1, 2)
        q = q.reshape(bsz * self.num_heads, tgt_len, self.head_dim)
        k = k.reshape(bsz * self.num_heads, -1, self.head_dim)
        v = v.reshape(bsz * self.num_heads, -1, self.head_dim)
        if incremental_state is not None:
            if "prev_key" in incremental_state:
                prev_key = incremental_state["prev_key"].view(bsz * self.num_heads, -1, self.head_dim)
                prev_value = incremental_state["prev_value"].view(bsz * self.num_heads, -1, self.head_dim)
                if tgt_len == 1:  # shared-prompt shortcut
                    prev_key = prev_key[: self.num_heads].repeat(bsz, 1, 1)
                    prev_value = prev_value[: self.num_heads].repeat(bsz, 1, 1)
                k = torch.cat([prev_key, k], dim=1)
                v = torch.cat([prev_value, v], dim=1)
            incremental_state["prev_key"] = k.view(bsz, self.num_heads, -1, self.head_dim)
            incremental_state["prev_value"] = v.view(bsz, self.num_heads, -1, self.head_dim)
        attn_weights = torch.bmm(q, k.transpose(1, 2))
        if attn_mask is not None:
            attn_weights = attn_weights + attn_mask.unsqueeze(0)
        sm = torch.float64 if attn_weights.dtype == torch.float64 else torch.float32
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=sm).type_as(attn_weights)
        attn = torch.bmm(attn_weights, v)
        attn = attn.transpose(0, 1).reshape(tgt_len, bsz, embed_dim).transpose(0, 1)
        if self.inner_attn_ln is not None:
            attn = self.inner_attn_ln(attn)
        attn = self.out_proj(attn)
        attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, -1).transpose(1, 0)
        return attn, attn_weights


class FeedForwardNetwork(nn.Module):
    def __init__(self, embed_dim, ffn_dim):
        super().__init__()
        self.fc1 = nn.Linear(embed_dim, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, embed_dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class DecoderLayer(nn.Module):
    def __init__(self, args, layer_idx):
        super().__init__()
        self.self_attn = MultiheadAttention(args.decoder_embed_dim, args.decoder_attention_heads, layer_idx)
        self.self_attn_layer_norm = nn.LayerNorm(args.decoder_embed_dim, eps=args.layernorm_eps)
        self.ffn = FeedForwardNetwork(args.decoder_embed_dim, args.decoder_ffn_embed_dim)
        self.final_layer_norm = nn.LayerNorm(args.decoder_embed_dim, eps=args.layernorm_eps)

    def forward(self, x, incremental_state=None, self_attn_mask=None):
        residual = x
        x = self.self_attn_layer_norm(x)
        x, attn = self.self_attn(x, x, x, incremental_state=incremental_state, attn_mask=self_attn_mask)
        x = residual + x
        residual = x
        x = self.ffn(self.final_layer_norm(x))
        return residual + x, attn


class Decoder(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.decoder_embed_dim)
        self.embed_scale = math.sqrt(args.decoder_embed_dim)
        self.embed_positions = PositionalEmbedding(args.max_target_positions, args.decoder_embed_dim)
        self.layernorm_embedding = nn.LayerNorm(args.decoder_embed_dim, eps=args.layernorm_eps)
        self.layers = nn.ModuleList([DecoderLayer(args, i) for i in range(args.decoder_layers)])
        self.layer_norm = nn.LayerNorm(args.decoder_embed_dim, eps=args.layernorm_eps)
        self.output_projection = nn.Linear(args.decoder_embed_dim, args.vocab_size, bias=False)

    def forward(self, prev_output_tokens, incremental_state=None):
        past_len = 0
        if incremental_state is not None and 0 in incremental_state and "prev_key" in incremental_state[0]:
            past_len = incremental_state[0]["prev_key"].shape[2]
        x = self.embed_scale * self.embed_tokens(prev_output_tokens)
        x = x + self.embed_positions(prev_output_tokens, past_len=past_len)
        x = self.layernorm_embedding(x)
        tgt_len = x.size(1)
        self_attn_mask = None
        if tgt_len > 1:
            self_attn_mask = torch.triu(torch.full((tgt_len, tgt_len), float("-inf"), dtype=x.dtype), 1)
            if past_len > 0:
                self_attn_mask = torch.cat([torch.zeros(tgt_len, past_len, dtype=x.dtype), self_attn_mask], 1)
        for idx, layer in enumerate(self.layers):
            if incremental_state is not None and idx not in incremental_state:
                incremental_state[idx] = {}
            x, _ = layer(
                x,
                incremental_state=incremental_state[idx] if incremental_state is not None else None,
                self_attn_mask=self_attn_mask,
            )
        return self.output_projection(self.layer_norm(x))


class DecoderLM(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.decoder = Decoder(args)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        incremental_state = past_key_values
        if use_cache and incremental_state is None:
            incremental_state = {}
        logits = self.decoder(input_ids, incremental_state=incremental_state if use_cache else None)
        return SimpleNamespace(logits=logits, past_key_values=incremental_state if use_cache else None)


def make_model():
    torch.manual_seed(1713)
    args = SimpleNamespace(
        vocab_size=96,
        decoder_embed_dim=64,
        decoder_ffn_embed_dim=128,
        decoder_attention_heads=4,
        decoder_layers=3,
        max_target_positions=64,
        layernorm_eps=1e-5,
    )
    model = DecoderLM(args)
    g = torch.Generator().manual_seed(17131)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
        model.decoder.embed_positions.weight.normal_(0.0, 0.3, generator=g)
    return model.eval()

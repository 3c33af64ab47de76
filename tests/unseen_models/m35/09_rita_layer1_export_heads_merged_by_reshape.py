"""RITA (lightonai/RITA, rita_modeling.py): autoregressive protein LM with rotary attention.

RITAModelForCausalLM: transformer (RITAModel: embedding, layers.N = DecoderLayer, final_norm)
and
lm_head without bias.  DecoderLayer is pre-LN: attn_norm -> self_attention -> + x, mlp_norm ->
mlp
(Linear, RITA's tanh GELU, Linear) -> + x.  SelfAttention is Karpathy's minGPT attention with
separate key / query / value Linear layers (bias), a RotaryEmbedding per layer (halves layout,
frequencies duplicated with cat, rotate_half, base 10000), q @ k^T / sqrt(head_dim), a boolean
causal
mask `(triu(ones) == 0).T` written into the last L x L block with masked_fill_(-inf), softmax,
merge
with transpose(1, 2).view, proj.  RITA ignores past_key_values; generation here keeps HF-style
legacy tuples (k, v) of shape (b, heads, T, head_dim), keys stored after the rotation, the
rotary
table offset by the cached length.
Cache: hf: `out = model(ids, use_cache=True)`, then
`model(tok, past_key_values=out.past_key_values, use_cache=True)`; logits in `out.logits`.
Slip: layer 1 is an ExportSelfAttention whose merge reshapes (N, heads, L, head_dim) straight to
(N, L, D), without the transpose: heads and tokens mixed.

"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": [
        "transformer.layers.0.self_attention",
        "transformer.layers.1.self_attention",
        "transformer.layers.2.self_attention",
    ],
    "kind": "causal-multihead",
    "cache": "hf",
    "layer": "transformer.layers.1.self_attention",
    "stage": "output",
    "mistake": "heads_merge",
    "style": "RITA; layer 1's attention merges (N, heads, L, hd) with reshape(N, L, D) and "
    "no transpose",
}


def rita_gelu(hidden_states):
    # RITA's jit-scripted tanh GELU
    inner = 0.79788456 * hidden_states * (1.0 + 0.044715 * hidden_states * hidden_states)
    return hidden_states * 0.5 * (1.0 + torch.tanh(inner))


class RITAGELU(nn.Module):
    def forward(self, hidden_states):
        return rita_gelu(hidden_states)


def rotate_half(x):
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class RotaryEmbedding(nn.Module):
    """RITA's rotary: one table per call, frequencies duplicated (halves layout), base 10000."""

    def __init__(self, config):
        super().__init__()
        self.head_dim = config.d_model // config.num_heads
        self.base = 10000.0

    def forward(self, x, offset=0):
        # x: (N, L, D); positions offset..offset+L-1, built in float64 then cast
        seq_len = x.shape[1]
        exponent = torch.arange(0, self.head_dim, 2, dtype=torch.float64, device=x.device)
        inv_freq = 1.0 / (self.base ** (exponent / self.head_dim))
        t = torch.arange(offset, offset + seq_len, dtype=torch.float64, device=x.device)
        freqs = torch.einsum("i,j->ij", t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos()[None, None].to(x.dtype), emb.sin()[None, None].to(x.dtype)

    def apply_rotary_pos_emb(self, q, k, cos, sin):
        return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class SelfAttention(nn.Module):
    """minGPT attention with rotary, as in rita_modeling.py; (k, v) cache added for generation."""

    def __init__(self, d_model, num_heads, num_layers, rotary_embedding=None, bias=True):
        super().__init__()
        self.d_model = d_model
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.num_layers = num_layers
        self.key = nn.Linear(d_model, d_model, bias=bias)
        self.query = nn.Linear(d_model, d_model, bias=bias)
        self.value = nn.Linear(d_model, d_model, bias=bias)
        self.proj = nn.Linear(d_model, d_model, bias=bias)
        self.rotary_embedding = rotary_embedding

    def forward(self, x, causal_mask=None, layer_past=None, use_cache=False):
        N, L, D = x.size()
        past_len = 0 if layer_past is None else layer_past[0].shape[2]
        k = self.key(x).view(N, L, self.num_heads, D // self.num_heads).transpose(1, 2)
        q = self.query(x).view(N, L, self.num_heads, D // self.num_heads).transpose(1, 2)
        v = self.value(x).view(N, L, self.num_heads, D // self.num_heads).transpose(1, 2)
        if self.rotary_embedding is not None:
            cos, sin = self.rotary_embedding(x, offset=past_len)
            q, k = self.rotary_embedding.apply_rotary_pos_emb(q, k, cos, sin)
        if layer_past is not None:
            k = torch.cat((layer_past[0], k), dim=2)
            v = torch.cat((layer_past[1], v), dim=2)
        present = (k, v) if use_cache else None
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        if causal_mask is not None:
            # RITA writes the mask into the last L x L block in place
            att[:, :, -L:, -L:].masked_fill_(causal_mask.view(1, 1, L, L), float("-inf"))
        att = F.softmax(att, dim=-1)
        y = att @ v
        return self.proj(self._merge_heads(y)), present

    def _merge_heads(self, y):
        N, _, L, _ = y.shape
        return y.transpose(1, 2).contiguous().view(N, L, self.d_model)


class ExportSelfAttention(SelfAttention):
    """SelfAttention from an export script that merges heads with a plain reshape."""

    def _merge_heads(self, y):
        N, _, L, _ = y.shape
        return y.reshape(N, L, self.d_model)


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        # rita_modeling passes config.dropout where num_layers is expected; kept as an int here
        attn_cls = ExportSelfAttention if layer_idx == 1 else SelfAttention
        rotary_cls = RotaryEmbedding
        self.self_attention = attn_cls(
            config.d_model,
            config.num_heads,
            config.num_layers,
            rotary_embedding=rotary_cls(config),
        )
        self.attn_norm = nn.LayerNorm(config.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(config.d_model, config.d_feedforward, bias=True),
            RITAGELU(),
            nn.Linear(config.d_feedforward, config.d_model, bias=True),
        )
        self.mlp_norm = nn.LayerNorm(config.d_model)

    def forward(self, x, causal_mask, layer_past=None, use_cache=False):
        y, present = self.self_attention(
            self.attn_norm(x), causal_mask=causal_mask, layer_past=layer_past, use_cache=use_cache
        )
        x = x + y
        x = x + self.mlp(self.mlp_norm(x))
        return x, present


class RITAModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embedding = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList([DecoderLayer(config, i) for i in range(config.num_layers)])
        self.final_norm = nn.LayerNorm(config.d_model)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        x = self.embedding(input_ids)
        L = input_ids.size(1)
        # True strictly above the diagonal: (triu(ones) == 0) transposed
        causal_mask = (torch.triu(torch.ones(L, L)) == 0).transpose(0, 1).contiguous()
        causal_mask = causal_mask.to(input_ids.device)
        presents = []
        for i, layer in enumerate(self.layers):
            past = None if past_key_values is None else past_key_values[i]
            x, present = layer(x, causal_mask, layer_past=past, use_cache=use_cache)
            presents.append(present)
        return self.final_norm(x), (tuple(presents) if use_cache else None)


class RITAModelForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = RITAModel(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        hidden, presents = self.transformer(
            input_ids, past_key_values=past_key_values, use_cache=use_cache
        )
        return SimpleNamespace(logits=self.lm_head(hidden), past_key_values=presents)


def make_model():
    torch.manual_seed(3509)
    config = SimpleNamespace(
        vocab_size=96,
        d_model=64,
        num_heads=4,
        num_layers=3,
        d_feedforward=128,
        max_seq_len=64,
    )
    model = RITAModelForCausalLM(config)
    g = torch.Generator().manual_seed(35091)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
            elif isinstance(m, nn.Linear) and m.bias is not None:
                m.bias.copy_(0.05 * torch.randn(m.bias.shape, generator=g))
    return model.eval()

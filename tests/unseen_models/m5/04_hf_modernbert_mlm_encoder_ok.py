"""ModernBERT in the shape of transformers' modeling_modernbert.py (written from memory, in my own
words), as ModernBertForMaskedLM: `model.embeddings` (tok_embeddings + bias-free LayerNorm, no
position embedding), `model.layers.N` with `attn_norm` (nn.Identity in layer 0, as in ModernBERT),
`attn` holding one fused `Wqkv` (no bias) viewed (bs, seq, 3, heads, head_dim), rotary with
rotate_half tables (global_rope_theta 160000), SDPA with an additive padding mask, `Wo`; `mlp_norm`
and a GeGLU `mlp` (Wi produces input and gate, Wo); `model.final_norm`; the MLM `head` (dense, GELU,
norm) and a `decoder` tied to the token embeddings.  All LayerNorms are bias-free (norm_bias=False).
4 heads of 16, 3 layers.

global_attn_every_n_layers = 1, so every layer is a global (bidirectional, unwindowed) layer; the
config still carries ModernBERT's `local_attention = (-64, 64)`, which no layer uses.
`model(ids)` or `model(ids, attention_mask)`; returns an object with `.logits`.  No cache.

Correct.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": ["model.layers.0.attn", "model.layers.1.attn", "model.layers.2.attn"],
    "kind": "multihead",
    "cache": None,
    "structure": {
        "heads": 4,
        "kv_heads": 4,
        "head_dim": 16,
        "causal": False,
        "cross": False,
        "rope": {"pairing": "half", "fraction": 1.0, "base": 160000.0},
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "modeling_modernbert.py MLM: fused Wqkv (bs,s,3,h,d), rotary base 160000, bias-free LayerNorms, "
    "Identity attn_norm in layer 0, GeGLU Wi/Wo, tied decoder; all layers global",
}


class ModernBertConfig:
    vocab_size = 200
    hidden_size = 64
    intermediate_size = 96
    num_hidden_layers = 3
    num_attention_heads = 4
    global_rope_theta = 160000.0
    local_attention = (-64, 64)
    global_attn_every_n_layers = 1
    norm_eps = 1e-5
    norm_bias = False


class ModernBertEmbeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=config.norm_bias)

    def forward(self, input_ids):
        return self.norm(self.tok_embeddings(input_ids))


class ModernBertRotaryEmbedding(nn.Module):
    def __init__(self, dim, base):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x, position_ids):
        freqs = position_ids[:, :, None].double() * self.inv_freq.double()[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class ModernBertAttention(nn.Module):
    def __init__(self, config, layer_id):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.all_head_size = self.head_dim * self.num_heads
        self.Wqkv = nn.Linear(config.hidden_size, 3 * self.all_head_size, bias=False)
        if layer_id % config.global_attn_every_n_layers != 0:
            self.local_attention = (config.local_attention[0] // 2, config.local_attention[1] // 2)
        else:
            self.local_attention = (-1, -1)
        self.rotary_emb = ModernBertRotaryEmbedding(self.head_dim, config.global_rope_theta)
        self.Wo = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask=None, position_ids=None):
        bs, seqlen, _ = hidden_states.shape
        qkv = self.Wqkv(hidden_states).view(bs, -1, 3, self.num_heads, self.head_dim)
        cos, sin = self.rotary_emb(qkv, position_ids=position_ids)
        query, key, value = qkv.transpose(3, 1).unbind(dim=2)
        query, key = apply_rotary_pos_emb(query, key, cos, sin)
        attn_output = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask)
        attn_output = attn_output.transpose(1, 2).contiguous().view(bs, -1, self.all_head_size)
        return (self.Wo(attn_output),)


class ModernBertMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.Wi = nn.Linear(config.hidden_size, int(config.intermediate_size) * 2, bias=False)
        self.Wo = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, hidden_states):
        input, gate = self.Wi(hidden_states).chunk(2, dim=-1)
        return self.Wo(F.gelu(input) * gate)


class ModernBertEncoderLayer(nn.Module):
    def __init__(self, config, layer_id):
        super().__init__()
        if layer_id == 0:
            self.attn_norm = nn.Identity()
        else:
            self.attn_norm = nn.LayerNorm(
                config.hidden_size, eps=config.norm_eps, bias=config.norm_bias
            )
        self.attn = ModernBertAttention(config, layer_id)
        self.mlp_norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=config.norm_bias)
        self.mlp = ModernBertMLP(config)

    def forward(self, hidden_states, attention_mask, position_ids):
        attn_outputs = self.attn(self.attn_norm(hidden_states), attention_mask, position_ids)
        hidden_states = hidden_states + attn_outputs[0]
        return hidden_states + self.mlp(self.mlp_norm(hidden_states))


class ModernBertModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embeddings = ModernBertEmbeddings(config)
        self.layers = nn.ModuleList(
            [ModernBertEncoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.final_norm = nn.LayerNorm(
            config.hidden_size, eps=config.norm_eps, bias=config.norm_bias
        )

    def forward(self, input_ids, attention_mask=None):
        bs, seqlen = input_ids.shape
        hidden_states = self.embeddings(input_ids)
        position_ids = torch.arange(seqlen).unsqueeze(0).expand(bs, -1)
        additive = None
        if attention_mask is not None:
            additive = torch.zeros(bs, 1, 1, seqlen, dtype=hidden_states.dtype)
            additive = additive.masked_fill(
                attention_mask[:, None, None, :] == 0, torch.finfo(hidden_states.dtype).min
            )
        for layer in self.layers:
            hidden_states = layer(hidden_states, additive, position_ids)
        return self.final_norm(hidden_states)


class ModernBertPredictionHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=config.norm_bias)

    def forward(self, hidden_states):
        return self.norm(F.gelu(self.dense(hidden_states)))


class MaskedLMOutput:
    def __init__(self, logits):
        self.logits = logits


class ModernBertForMaskedLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = ModernBertModel(config)
        self.head = ModernBertPredictionHead(config)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size, bias=True)
        self.decoder.weight = self.model.embeddings.tok_embeddings.weight

    def forward(self, input_ids, attention_mask=None):
        return MaskedLMOutput(self.decoder(self.head(self.model(input_ids, attention_mask))))


def make_model():
    torch.manual_seed(5404)
    model = ModernBertForMaskedLM(ModernBertConfig())
    with torch.no_grad():
        model.model.embeddings.tok_embeddings.weight.mul_(0.5)
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn_like(m.weight))
    return model.eval()

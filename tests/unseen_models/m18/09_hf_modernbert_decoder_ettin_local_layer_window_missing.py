"""transformers modeling_modernbert_decoder.py (ModernBertDecoderForCausalLM, the Ettin decoders).

ModernBertDecoderForCausalLM: `model` (ModernBertDecoderModel: `embeddings` (tok_embeddings + bias-free
LayerNorm `norm`), `layers.N`, `final_norm`), `lm_head` (dense, GELU, norm) and `decoder` tied to the
token embeddings.  ModernBertDecoderLayer: `attn_norm` (Identity on layer 0, the embeddings are
already normed), `attn`, `mlp_norm`, `mlp` (Wi -> GLU-GELU -> Wo).  ModernBertDecoderAttention: fused
bias-free `Wqkv` viewed (b, s, 3, h, d), rotate_half rotary with global theta 1.6e5 on global layers
and local theta 1e4 on local layers, scaling head_dim**-0.5, eager matmul + additive finfo.min mask,
`Wo`.  `global_attn_every_n_layers` 3: layer 0 global, layers 1 and 2 local; `config.layer_types`
says so and every local attention declares `sliding_window` = local_attention // 2 = 4 (a query sees
itself and the 3 keys before it).  MHA 4 x 16.
Slip: the decoder loop picks each layer's mask with the encoder's old rule
`"sliding_attention" if layer.layer_idx % 3 == 1 else "full_attention"` (written when ModernBERT had
2 layers per global one) instead of reading `layer.attention_type`: layer 2, which declares the
window, gets the full causal mask.  No cache.  Returns the logits tensor.
"""

from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": [
        "model.layers.0.attn",
        "model.layers.1.attn",
        "model.layers.2.attn",
    ],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "model.layers.2.attn",
    "stage": "masked_scores",
    "mistake": "window_missing",
    "style": "modeling_modernbert_decoder.py (Ettin): embeddings + LayerNorm, Identity attn_norm on layer 0, fused Wqkv "
    "(b, s, 3, h, d), global/local rope thetas, global every 3rd layer, local sliding_window 4, GLU MLP Wi/Wo, "
    "prediction head + tied decoder; the loop's old index rule hands local layer 2 the full causal mask",
}


class ModernBertDecoderEmbeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=False)

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
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class ModernBertDecoderAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.all_head_size = self.head_dim * self.num_heads
        self.scaling = self.head_dim**-0.5
        self.is_causal = True
        if config.layer_types[layer_idx] == "sliding_attention":
            self.sliding_window = config.local_attention // 2
            rope_theta = config.local_rope_theta
        else:
            self.sliding_window = None
            rope_theta = config.global_rope_theta
        self.Wqkv = nn.Linear(config.hidden_size, 3 * self.all_head_size, bias=config.attention_bias)
        self.Wo = nn.Linear(config.hidden_size, config.hidden_size, bias=config.attention_bias)
        self.rotary_emb = ModernBertRotaryEmbedding(self.head_dim, rope_theta)

    def forward(self, hidden_states, position_ids, attention_mask):
        bs, seq_len = hidden_states.shape[:2]
        qkv = self.Wqkv(hidden_states).view(bs, -1, 3, self.num_heads, self.head_dim)
        query, key, value = qkv.transpose(3, 1).unbind(dim=2)
        cos, sin = self.rotary_emb(hidden_states, position_ids)
        query, key = apply_rotary_pos_emb(query, key, cos, sin)
        attn_weights = torch.matmul(query, key.transpose(2, 3)) * self.scaling
        attn_weights = attn_weights + attention_mask[:, :, :, : key.shape[-2]]
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, value).transpose(1, 2).contiguous()
        return self.Wo(attn_output.view(bs, seq_len, self.all_head_size))


class ModernBertMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.Wi = nn.Linear(config.hidden_size, int(config.intermediate_size) * 2, bias=config.mlp_bias)
        self.Wo = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, hidden_states):
        inp, gate = self.Wi(hidden_states).chunk(2, dim=-1)
        return self.Wo(F.gelu(inp) * gate)


class ModernBertDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.attention_type = config.layer_types[layer_idx]
        if layer_idx == 0:
            self.attn_norm = nn.Identity()
        else:
            self.attn_norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=False)
        self.attn = ModernBertDecoderAttention(config, layer_idx)
        self.mlp_norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=False)
        self.mlp = ModernBertMLP(config)

    def forward(self, hidden_states, position_ids, attention_mask):
        residual = hidden_states
        hidden_states = residual + self.attn(self.attn_norm(hidden_states), position_ids, attention_mask)
        return hidden_states + self.mlp(self.mlp_norm(hidden_states))


def _mask(seq_len, dtype, device, window=None):
    i = torch.arange(seq_len, device=device)[:, None]
    j = torch.arange(seq_len, device=device)[None, :]
    allowed = j <= i
    if window is not None:
        allowed = allowed & (i - j < window)
    return torch.zeros(seq_len, seq_len, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


class ModernBertDecoderModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embeddings = ModernBertDecoderEmbeddings(config)
        self.layers = nn.ModuleList([ModernBertDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.final_norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=False)

    def forward(self, input_ids):
        seq_len = input_ids.shape[1]
        hidden_states = self.embeddings(input_ids)
        position_ids = torch.arange(seq_len, device=input_ids.device).unsqueeze(0)
        dtype = hidden_states.dtype
        masks = {
            "full_attention": _mask(seq_len, dtype, input_ids.device),
            "sliding_attention": _mask(seq_len, dtype, input_ids.device, self.config.local_attention // 2),
        }
        for layer in self.layers:
            kind = "sliding_attention" if layer.layer_idx % 3 == 1 else "full_attention"
            hidden_states = layer(hidden_states, position_ids, masks[kind])
        return self.final_norm(hidden_states)


class ModernBertPredictionHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size, config.classifier_bias)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=False)

    def forward(self, hidden_states):
        return self.norm(F.gelu(self.dense(hidden_states)))


class ModernBertDecoderForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = ModernBertDecoderModel(config)
        self.lm_head = ModernBertPredictionHead(config)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size, bias=config.decoder_bias)
        self.decoder.weight = self.model.embeddings.tok_embeddings.weight

    def forward(self, input_ids):
        return self.decoder(self.lm_head(self.model(input_ids)))


def make_model():
    torch.manual_seed(1809)
    config = SimpleNamespace(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        norm_eps=1e-5, pad_token_id=0, attention_bias=False, mlp_bias=False, classifier_bias=False,
        decoder_bias=True, global_rope_theta=160000.0, local_rope_theta=10000.0, local_attention=8,
        global_attn_every_n_layers=3, sliding_window=4,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"],
    )
    model = ModernBertDecoderForCausalLM(config)
    g = torch.Generator().manual_seed(18091)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

"""BlueLM (vivo-ai, remote code modeling_bluelm.py), reduced.

BlueLMForCausalLM: model (BlueLMModel: embed_tokens, embed_layer_norm -- a LayerNorm with bias right
after the embeddings, BlueLM's addition to the Llama tree -- layers.N, norm) and lm_head.
BlueLMDecoderLayer: input_layernorm -> self_attn -> + residual, post_attention_layernorm -> mlp
(gate/up/down, SiLU).  BlueLMAttention: q_proj/k_proj/v_proj/o_proj without bias, 4 heads, rotary
(rotate_half, base 1e4) from a `BlueLMRotaryEmbedding` cos/sin cache gathered by position_ids, matmul /
sqrt(head_dim), additive finfo.min causal mask, float32-or-wider softmax.
Slip: layer 1 is a `BlueLMLongContextAttention` (chosen by `config.long_context_layers`) whose scores are
divided by head_dim (16) instead of sqrt(head_dim) (4): a muP-style 1/d left in one subclass.
No cache.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["model.layers.0.self_attn", "model.layers.1.self_attn", "model.layers.2.self_attn"],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "model.layers.1.self_attn",
    "stage": "scaled_scores",
    "mistake": "wrong_scale",
    "style": "BlueLM modeling_bluelm.py: embed_layer_norm after embeddings, rotate_half cos/sin cache by position_ids, "
    "finfo.min additive mask; layer 1's long-context subclass scales by 1/head_dim (1/16) instead of 1/sqrt(16)",
}


class BlueLMRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class BlueLMRotaryEmbedding(nn.Module):
    def __init__(self, dim, max_position_embeddings=128, base=10000.0):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        t = torch.arange(max_position_embeddings, dtype=torch.float64)
        emb = torch.cat((torch.einsum("i,j->ij", t, inv_freq),) * 2, dim=-1)
        self.register_buffer("cos_cached", emb.cos()[None, None], persistent=False)
        self.register_buffer("sin_cached", emb.sin()[None, None], persistent=False)

    def forward(self, x, seq_len):
        return self.cos_cached[:, :, :seq_len].to(x.dtype), self.sin_cached[:, :, :seq_len].to(x.dtype)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids):
    cos = cos.squeeze(1).squeeze(0)[position_ids].unsqueeze(1)
    sin = sin.squeeze(1).squeeze(0)[position_ids].unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class BlueLMAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.q_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=False)
        self.k_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=False)
        self.v_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=False)
        self.o_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=False)
        self.rotary_emb = BlueLMRotaryEmbedding(self.head_dim)

    def _scale(self):
        return math.sqrt(self.head_dim)

    def forward(self, hidden_states, attention_mask, position_ids):
        bsz, q_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary_emb(value_states, seq_len=q_len)
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin, position_ids)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / self._scale()
        attn_weights = attn_weights + attention_mask
        attn_weights = torch.max(attn_weights, torch.tensor(torch.finfo(attn_weights.dtype).min))
        soft_dtype = torch.promote_types(query_states.dtype, torch.float32)
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=soft_dtype).to(query_states.dtype)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, self.hidden_size)
        return self.o_proj(attn_output)


class BlueLMLongContextAttention(BlueLMAttention):
    def _scale(self):
        return float(self.head_dim)


class BlueLMMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class BlueLMDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        cls = BlueLMLongContextAttention if layer_idx in config.long_context_layers else BlueLMAttention
        self.self_attn = cls(config)
        self.mlp = BlueLMMLP(config)
        self.input_layernorm = BlueLMRMSNorm(config.hidden_size)
        self.post_attention_layernorm = BlueLMRMSNorm(config.hidden_size)

    def forward(self, hidden_states, attention_mask, position_ids):
        hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states), attention_mask, position_ids)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class BlueLMModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_layer_norm = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.layers = nn.ModuleList([BlueLMDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = BlueLMRMSNorm(config.hidden_size)

    def forward(self, input_ids):
        bsz, q_len = input_ids.shape
        position_ids = torch.arange(q_len, device=input_ids.device).unsqueeze(0).expand(bsz, -1)
        hidden_states = self.embed_layer_norm(self.embed_tokens(input_ids))
        mask = torch.full((q_len, q_len), torch.finfo(hidden_states.dtype).min, dtype=hidden_states.dtype)
        mask = torch.triu(mask, diagonal=1)[None, None]
        for layer in self.layers:
            hidden_states = layer(hidden_states, mask, position_ids)
        return self.norm(hidden_states)


class BlueLMForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = BlueLMModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids):
        return SimpleNamespace(logits=self.lm_head(self.model(input_ids)))


def make_model():
    torch.manual_seed(1106)
    config = SimpleNamespace(vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                             num_attention_heads=4, long_context_layers=(1,))
    model = BlueLMForCausalLM(config)
    g = torch.Generator().manual_seed(11061)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, BlueLMRMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
            elif isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model.eval()

"""ModernBERT style encoder layer (local-attention layer): fused Wqkv without bias,
rotate_half rotary with local_rope_theta 10000, symmetric sliding window of
local_attention=16 (a token sees 8 to each side, itself included: 17 keys), built
by the layer from its config; post-attention residual with pre-norm attn_norm.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ModernBertMiniConfig:
    hidden_size: int = 64
    num_attention_heads: int = 4
    local_attention: int = 16
    global_attn_every_n_layers: int = 3
    global_rope_theta: float = 160000.0
    local_rope_theta: float = 10000.0
    norm_eps: float = 1e-5


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class ModernBertRotary(nn.Module):
    def __init__(self, dim, base):
        super().__init__()
        self.register_buffer(
            "inv_freq",
            1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).double() / dim)),
            persistent=False,
        )

    def forward(self, x, position_ids):
        freqs = (self.inv_freq[None, :, None] @ position_ids[:, None, :].double()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class ModernBertAttention(nn.Module):
    def __init__(self, config, layer_id):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.all_head_size = self.head_dim * self.num_heads
        self.Wqkv = nn.Linear(config.hidden_size, 3 * self.all_head_size, bias=False)
        if layer_id % config.global_attn_every_n_layers != 0:
            self.local_attention = (config.local_attention // 2, config.local_attention // 2)
            base = config.local_rope_theta
        else:
            self.local_attention = (-1, -1)
            base = config.global_rope_theta
        self.rotary_emb = ModernBertRotary(self.head_dim, base)
        self.Wo = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask, sliding_window_mask, position_ids):
        bs, t, _ = hidden_states.shape
        qkv = self.Wqkv(hidden_states).view(bs, -1, 3, self.num_heads, self.head_dim)
        cos, sin = self.rotary_emb(hidden_states, position_ids)
        q, k, v = qkv.transpose(3, 1).unbind(dim=2)  # (bs, heads, t, dim)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        mask = sliding_window_mask if self.local_attention != (-1, -1) else attention_mask
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out = out.transpose(1, 2).contiguous().view(bs, -1, self.all_head_size)
        return self.Wo(out)


class ModernBertEncoderLayer(nn.Module):
    def __init__(self, config, layer_id):
        super().__init__()
        self.config = config
        self.attn_norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=False)
        self.attn = ModernBertAttention(config, layer_id)

    def forward(self, hidden_states):
        bs, t, _ = hidden_states.shape
        position_ids = torch.arange(t).unsqueeze(0)
        global_mask = torch.zeros(bs, 1, t, t, dtype=hidden_states.dtype)
        rows = torch.arange(t).unsqueeze(0)
        distance = torch.abs(rows - rows.T)
        window = (distance <= self.config.local_attention // 2)[None, None]
        sliding = global_mask.masked_fill(~window, torch.finfo(hidden_states.dtype).min)
        return hidden_states + self.attn(
            self.attn_norm(hidden_states), global_mask, sliding, position_ids
        )


def make_local_layer():
    torch.manual_seed(6)
    layer = ModernBertEncoderLayer(ModernBertMiniConfig(), layer_id=1)
    with torch.no_grad():
        layer.attn_norm.weight.uniform_(0.5, 1.5)
    return layer


EXPECT = {
    "target": "make_local_layer",
    "kind": "multihead",
    "ok": True,
    "layer": "attn",
    "structure": {
        "heads": 4,
        "kv_heads": 4,
        "head_dim": 16,
        "causal": False,
        "cross": False,
        "rope": {"pairing": "half", "fraction": 1.0, "base": 10000},
        "qk_norm": None,
        "window": 17,
        "bias": None,
    },
    "style": "HF ModernBERT local layer (layer_id 1 of global_attn_every_n_layers 3): fused Wqkv viewed (bs,t,3,h,d), "
    "local_rope_theta 10000, symmetric window |i-j| <= local_attention//2 = 8 (17 keys incl. itself), SDPA",
}

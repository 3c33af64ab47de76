"""Arcee (AFM) style decoder body using an SDPA attention interface that derives
is_causal from the module (`is_causal = q_len > 1 and mask is None and
module.is_causal`).  The model builds no mask when no padding mask is given, and the
attention class was copied from a bidirectional encoder with is_causal = False, so
the decoder runs without any causal mask.
"""

import torch
import torch.nn.functional as F
from torch import nn


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def sdpa_attention_forward(module, query, key, value, attention_mask, scaling):
    is_causal = query.shape[2] > 1 and attention_mask is None and getattr(module, "is_causal", True)
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, is_causal=is_causal, scale=scaling
    ).transpose(1, 2)


class ArceeAttention(nn.Module):
    def __init__(self, hidden=64, heads=4, head_dim=16):
        super().__init__()
        self.head_dim = head_dim
        self.scaling = head_dim**-0.5
        self.is_causal = False
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    def forward(self, hidden_states, position_embeddings, attention_mask=None):
        input_shape = hidden_states.shape[:-1]
        hs = (*input_shape, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(hs).transpose(1, 2)
        k = self.k_proj(hidden_states).view(hs).transpose(1, 2)
        v = self.v_proj(hidden_states).view(hs).transpose(1, 2)
        cos, sin = position_embeddings
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        out = sdpa_attention_forward(self, q, k, v, attention_mask, self.scaling)
        return self.o_proj(out.reshape(*input_shape, -1).contiguous()), None


class ArceeModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(
            [
                nn.ModuleDict(
                    {"input_layernorm": nn.RMSNorm(64, eps=1e-5), "self_attn": ArceeAttention()}
                )
            ]
        )
        self.register_buffer(
            "inv_freq", 1.0 / 10000.0 ** (torch.arange(0, 16, 2).double() / 16), persistent=False
        )

    def forward(self, inputs_embeds, attention_mask=None):
        b, t, _ = inputs_embeds.shape
        cache_position = torch.arange(t)
        position_ids = cache_position[None].expand(b, t)
        causal_mask = None
        if attention_mask is not None:
            causal_mask = (
                torch.tril(torch.ones(t, t, dtype=torch.bool))[None, None]
                & attention_mask[:, None, None].bool()
            )
        freqs = position_ids[..., None].double() * self.inv_freq
        emb = torch.cat((freqs, freqs), -1)
        pe = (emb.cos().to(inputs_embeds.dtype), emb.sin().to(inputs_embeds.dtype))
        h = inputs_embeds
        for layer in self.layers:
            a, _ = layer["self_attn"](layer["input_layernorm"](h), pe, causal_mask)
            h = h + a
        return h


def make_arcee():
    torch.manual_seed(122)
    m = ArceeModel()
    with torch.no_grad():
        m.layers[0]["input_layernorm"].weight.uniform_(0.5, 1.5)
    return m


EXPECT = {
    "target": "make_arcee",
    "kind": "causal-multihead",
    "ok": False,
    "layer": "layers.0.self_attn",
    "stage": "masked_scores",
    "mistake": "missing_mask",
    "style": "HF Arcee decoder body with the sdpa_attention_forward is_causal rule: attention class has "
    "is_causal = False and the model passes no mask, so no causal masking at all",
}

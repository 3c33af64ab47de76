"""NVIDIA TransformerEngine `MultiheadAttention` written out in plain torch (sbhd layout): a fused
`qkv` Linear interleaved per GQA group and split `[np/ng, 1, 1]`, `qk_norm_type` per-head norms with
`qk_norm_before_rope`, TE's `RotaryPositionEmbedding(dim, rotary_percent)` +
`apply_rotary_pos_emb(..., 'sbhd')` (halves on the first rot_dim dims), the unfused backend (`(b*np,
sq, hn)` bmm, -10000.0 mask fill, `window_size=(left, right)`).

This file: one bug: the k_norm call is indented under `if inference_params is not None:`, so in a
plain forward the keys are never normed (the queries are)."""

import torch
from torch import nn

class TransformerConfig:
    hidden_size = 64
    num_attention_heads = 4
    num_gqa_groups = 2
    rotary_percent = 0.5
    rotary_base = 10000
    qk_norm_type = "RMSNorm"
    qk_norm_eps = 1e-6
    attn_mask_type = "causal"
    sliding_window = 8

class RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight

class RotaryPositionEmbedding(nn.Module):
    """TransformerEngine-style: rotates the first `rotary_percent` of each head, halves pairing,
    returns `freqs` of shape [s, 1, 1, rot_dim] (sbhd)."""

    def __init__(self, dim, rotary_percent=1.0, rotary_base=10000):
        super().__init__()
        dim = int(dim * rotary_percent)
        inv_freq = 1.0 / (rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, max_seq_len, offset=0):
        seq = torch.arange(max_seq_len, dtype=torch.float64, device=self.inv_freq.device) + offset
        freqs = torch.einsum("i,j->ij", seq, self.inv_freq.to(torch.float64))
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.reshape(emb.size(0), 1, 1, emb.size(1))

def _rotate_half(x):
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)

def apply_rotary_pos_emb(t, freqs, tensor_format="sbhd"):
    assert tensor_format == "sbhd"
    rot_dim = freqs.shape[-1]
    t, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    cos_ = torch.cos(freqs).to(t.dtype)
    sin_ = torch.sin(freqs).to(t.dtype)
    t = (t * cos_) + (_rotate_half(t) * sin_)
    return torch.cat((t, t_pass), dim=-1)

class UnfusedDotProductAttention(nn.Module):
    """TE's unfused backend in plain torch: (b * np, sq, hn) bmm, -10000.0 mask fill
    (FusedScaleMaskSoftmax's mask_func), softmax, bmm with the values."""

    def __init__(self, softmax_scale):
        super().__init__()
        self.softmax_scale = softmax_scale

    def forward(self, query_layer, key_layer, value_layer, attn_mask_type="causal", window_size=None):
        sq, b, np_, hn = query_layer.shape
        sk = key_layer.shape[0]
        if key_layer.shape[2] != np_:
            key_layer = key_layer.repeat_interleave(np_ // key_layer.shape[2], dim=2)
            value_layer = value_layer.repeat_interleave(np_ // value_layer.shape[2], dim=2)
        q = query_layer.reshape(sq, b * np_, hn).transpose(0, 1)
        k = key_layer.reshape(sk, b * np_, hn).transpose(0, 1)
        v = value_layer.reshape(sk, b * np_, hn).transpose(0, 1)
        scores = torch.bmm(q, k.transpose(1, 2)) * self.softmax_scale
        scores = scores.view(b, np_, sq, sk)
        i = torch.arange(sq, device=scores.device)[:, None] + (sk - sq)
        j = torch.arange(sk, device=scores.device)[None, :]
        mask = torch.zeros(sq, sk, dtype=torch.bool, device=scores.device)
        if "causal" in attn_mask_type:
            mask = mask | (j > i)
        if window_size is not None:
            left, right = window_size
            if left >= 0:
                mask = mask | (j < i - left)
            if right >= 0:
                mask = mask | (j > i + right)
        scores = scores.masked_fill(mask, -10000.0)
        probs = torch.softmax(scores, dim=-1).view(b * np_, sq, sk)
        context = torch.bmm(probs, v)
        context = context.view(b, np_, sq, hn).permute(2, 0, 1, 3).contiguous()
        return context.view(sq, b, np_ * hn)

class MultiheadAttention(nn.Module):
    def __init__(self, config, layer_number=1):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_attention_heads = config.num_attention_heads
        self.num_gqa_groups = config.num_gqa_groups
        self.hidden_size_per_attention_head = config.hidden_size // config.num_attention_heads
        self.attn_mask_type = config.attn_mask_type
        self.window_size = (config.sliding_window - 1, 0)
        self.qk_norm_before_rope = True
        hn = self.hidden_size_per_attention_head
        # TE's fused QKV weight is interleaved per GQA group: [q heads of the group, k, v]
        self.qkv = nn.Linear(
            self.hidden_size, (self.num_attention_heads + 2 * self.num_gqa_groups) * hn, bias=True
        )
        if config.qk_norm_type == "RMSNorm":
            self.q_norm = RMSNorm(hn, config.qk_norm_eps)
            self.k_norm = RMSNorm(hn, config.qk_norm_eps)
        else:
            self.q_norm = nn.LayerNorm(hn, eps=config.qk_norm_eps)
            self.k_norm = nn.LayerNorm(hn, eps=config.qk_norm_eps)
        self.core_attention = UnfusedDotProductAttention(softmax_scale=hn ** -0.5)
        self.proj = nn.Linear(self.hidden_size, self.hidden_size, bias=True)

    def forward(self, hidden_states, rotary_pos_emb=None, inference_params=None):
        # hidden_states: [sq, b, h]
        sq, b, _ = hidden_states.shape
        ng = self.num_gqa_groups
        hn = self.hidden_size_per_attention_head
        per_group = self.num_attention_heads // ng
        mixed_x_layer = self.qkv(hidden_states).view(sq, b, ng, per_group + 2, hn)
        query_layer, key_layer, value_layer = torch.split(mixed_x_layer, [per_group, 1, 1], dim=3)
        query_layer = query_layer.reshape(sq, b, self.num_attention_heads, hn)
        key_layer = key_layer.reshape(sq, b, ng, hn)
        value_layer = value_layer.reshape(sq, b, ng, hn)

        if self.qk_norm_before_rope:
            query_layer = self.q_norm(query_layer)
            if inference_params is not None:
                key_layer = self.k_norm(key_layer)

        if rotary_pos_emb is not None:
            query_layer = apply_rotary_pos_emb(query_layer, rotary_pos_emb, tensor_format="sbhd")
            key_layer = apply_rotary_pos_emb(key_layer, rotary_pos_emb, tensor_format="sbhd")

        if not self.qk_norm_before_rope:
            query_layer = self.q_norm(query_layer)
            key_layer = self.k_norm(key_layer)

        context_layer = self.core_attention(
            query_layer,
            key_layer,
            value_layer,
            attn_mask_type=self.attn_mask_type,
            window_size=self.window_size,
        )
        return self.proj(context_layer)

class TransformerLayer(nn.Module):
    """Only the attention half of te.TransformerLayer: the body builds the rotary table and runs sbhd."""

    def __init__(self, config):
        super().__init__()
        self.self_attention = MultiheadAttention(config)
        self.rotary = RotaryPositionEmbedding(
            config.hidden_size // config.num_attention_heads,
            rotary_percent=config.rotary_percent,
            rotary_base=config.rotary_base,
        )

    def forward(self, x):
        hidden_states = x.transpose(0, 1)  # bshd -> sbhd
        rotary_pos_emb = self.rotary(hidden_states.shape[0])
        out = self.self_attention(hidden_states, rotary_pos_emb=rotary_pos_emb)
        return out.transpose(0, 1)

def make_te_swa_layer():
    torch.manual_seed(1616)
    layer = TransformerLayer(TransformerConfig())
    with torch.no_grad():
        attn = layer.self_attention
        for norm in (attn.q_norm, attn.k_norm):
            norm.weight.uniform_(0.5, 1.5)
            if getattr(norm, "bias", None) is not None:
                norm.bias.uniform_(-0.3, 0.3)
    return layer.eval()


EXPECT = {
    "target": "make_te_swa_layer",
    "kind": "causal-multihead",
    "ok": False,
    "layer": "self_attention",
    "stage": "normed_keys",
    "mistake": "qk_norm_missing",
    "style": "TransformerEngine: k_norm only applied when inference_params is set; plain forward skips the key norm"
}

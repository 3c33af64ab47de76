"""Qwen (1st gen, Qwen-7B remote code) QWenAttention in a QWenBlock/QWenModel body: fused c_attn
(bias) split(split_size, dim=2), _split_heads to (B, T, H, D), the RotaryEmbedding cache of
cat(freqs, freqs) laid out 'n d -> 1 n 1 d' (einops) with partial rotary (rotary_pct),
_rotate_half by rearrange '... (j d) -> ... j d', permute to (B, H, T, D), _attn: matmul, division by
torch.full([], sqrt(head_dim)), bool tril causal mask with torch.where(finfo.min), the model's additive
padding mask, softmax, c_proj without bias.

This file: bug. The cache is laid out for interleaved pairs (repeat_interleave(freqs, 2)) but
applied with _rotate_half (halves)."""

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn


class QWenConfig:
    hidden_size = 64
    num_attention_heads = 4
    kv_channels = 16
    rotary_pct = 0.5
    rotary_emb_base = 10000
    intermediate_size = 256
    layer_norm_epsilon = 1e-6
    no_bias = True
    num_hidden_layers = 1


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        return self._norm(x) * self.weight


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, base=10000):
        super().__init__()
        self.dim = dim
        self.base = base
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._seq_len_cached = 0
        self._rotary_pos_emb_cache = None

    def update_rotary_pos_emb_cache(self, seqlen):
        cache = self._rotary_pos_emb_cache
        if seqlen > self._seq_len_cached or cache[0].dtype != self.inv_freq.dtype:
            self._seq_len_cached = seqlen
            seq = torch.arange(seqlen, device=self.inv_freq.device, dtype=self.inv_freq.dtype)
            freqs = torch.outer(seq, self.inv_freq)
            emb = torch.repeat_interleave(freqs, 2, dim=-1)
            emb = rearrange(emb, "n d -> 1 n 1 d")
            cos, sin = emb.cos(), emb.sin()
            self._rotary_pos_emb_cache = [cos, sin]

    def forward(self, max_seq_len):
        self.update_rotary_pos_emb_cache(max_seq_len)
        cos, sin = self._rotary_pos_emb_cache
        return [cos[:, :max_seq_len], sin[:, :max_seq_len]]


def _rotate_half(x):
    x = rearrange(x, "... (j d) -> ... j d", j=2)
    x1, x2 = x.unbind(dim=-2)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(t, freqs):
    cos, sin = freqs
    rot_dim = freqs[0].shape[-1]
    t_, t_pass_ = t[..., :rot_dim], t[..., rot_dim:]
    t_ = (t_ * cos.type_as(t_)) + (_rotate_half(t_) * sin.type_as(t_))
    return torch.cat((t_, t_pass_), dim=-1)


class QWenAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.split_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.scale_attn_weights = True
        self.projection_size = config.kv_channels * config.num_attention_heads
        self.c_attn = nn.Linear(config.hidden_size, 3 * self.projection_size)
        self.c_proj = nn.Linear(config.hidden_size, self.projection_size, bias=not config.no_bias)

    def _attn(self, query, key, value, causal_mask=None, attention_mask=None):
        attn_weights = torch.matmul(query, key.transpose(-1, -2))
        if self.scale_attn_weights:
            attn_weights = attn_weights / torch.full(
                [], value.size(-1) ** 0.5, dtype=attn_weights.dtype, device=attn_weights.device
            )
        if causal_mask is not None:
            mask_value = torch.finfo(attn_weights.dtype).min
            mask_value = torch.full([], mask_value, dtype=attn_weights.dtype).to(
                attn_weights.device
            )
            attn_weights = torch.where(causal_mask, attn_weights.to(attn_weights.dtype), mask_value)
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_weights = attn_weights.type(value.dtype)
        attn_output = torch.matmul(attn_weights, value)
        attn_output = attn_output.transpose(1, 2)
        return attn_output, attn_weights

    def _split_heads(self, tensor, num_heads, attn_head_size):
        new_shape = tensor.size()[:-1] + (num_heads, attn_head_size)
        tensor = tensor.view(new_shape)
        return tensor

    def _merge_heads(self, tensor, num_heads, attn_head_size):
        tensor = tensor.contiguous()
        new_shape = tensor.size()[:-2] + (num_heads * attn_head_size,)
        return tensor.view(new_shape)

    def forward(self, hidden_states, rotary_pos_emb_list=None, attention_mask=None):
        mixed_x_layer = self.c_attn(hidden_states)
        query, key, value = mixed_x_layer.split(self.split_size, dim=2)
        query = self._split_heads(query, self.num_heads, self.head_dim)
        key = self._split_heads(key, self.num_heads, self.head_dim)
        value = self._split_heads(value, self.num_heads, self.head_dim)
        if rotary_pos_emb_list is not None:
            cur_len = query.shape[1]
            rotary_pos_emb = rotary_pos_emb_list[0]
            rotary_pos_emb = [i[:, -cur_len:, :, :] for i in rotary_pos_emb]
            rotary_pos_emb = (rotary_pos_emb,) * 2
            q_pos_emb, k_pos_emb = rotary_pos_emb
            query = apply_rotary_pos_emb(query, q_pos_emb)
            key = apply_rotary_pos_emb(key, k_pos_emb)
        query = query.permute(0, 2, 1, 3)
        key = key.permute(0, 2, 1, 3)
        value = value.permute(0, 2, 1, 3)
        key_size = key.size(2)
        if query.size(2) == key_size:
            causal_mask = torch.tril(
                torch.ones((key_size, key_size), dtype=torch.bool, device=key.device)
            ).view(1, 1, key_size, key_size)
        else:
            causal_mask = None
        attn_output, attn_weight = self._attn(query, key, value, causal_mask, attention_mask)
        context_layer = self._merge_heads(attn_output, self.num_heads, self.head_dim)
        attn_output = self.c_proj(context_layer)
        return (attn_output, None)


class QWenMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        ff_dim_in = config.intermediate_size // 2
        self.w1 = nn.Linear(config.hidden_size, ff_dim_in, bias=not config.no_bias)
        self.w2 = nn.Linear(config.hidden_size, ff_dim_in, bias=not config.no_bias)
        self.c_proj = nn.Linear(ff_dim_in, config.hidden_size, bias=not config.no_bias)

    def forward(self, hidden_states):
        a1 = self.w1(hidden_states)
        a2 = self.w2(hidden_states)
        return self.c_proj(a1 * F.silu(a2))


class QWenBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.attn = QWenAttention(config)
        self.ln_2 = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.mlp = QWenMLP(config)

    def forward(self, hidden_states, rotary_pos_emb_list=None, attention_mask=None):
        layernorm_output = self.ln_1(hidden_states)
        attn_outputs = self.attn(
            layernorm_output, rotary_pos_emb_list, attention_mask=attention_mask
        )
        layernorm_input = attn_outputs[0] + hidden_states
        layernorm_output = self.ln_2(layernorm_input)
        return self.mlp(layernorm_output) + layernorm_input


class QWenModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.h = nn.ModuleList([QWenBlock(config) for _ in range(config.num_hidden_layers)])
        rot_dim = int(config.kv_channels * config.rotary_pct)
        self.rotary_emb = RotaryEmbedding(rot_dim, base=config.rotary_emb_base)
        self.ln_f = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)

    def forward(self, hidden_states):
        batch_size, seq_len, _ = hidden_states.shape
        attention_mask = hidden_states.new_ones(batch_size, seq_len)
        attention_mask = attention_mask[:, None, None, :]
        attention_mask = (1.0 - attention_mask) * torch.finfo(hidden_states.dtype).min
        rotary_pos_emb_list = [self.rotary_emb(seq_len)]
        for block in self.h:
            hidden_states = block(hidden_states, rotary_pos_emb_list, attention_mask=attention_mask)
        return self.ln_f(hidden_states)


def make_qwen():
    torch.manual_seed(1317)
    model = QWenModel(QWenConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, RMSNorm):
                mod.weight.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {
    "target": "make_qwen",
    "kind": "causal-multihead",
    "ok": False,
    "layer": "h.0.attn",
    "stage": "rotated_queries",
    "mistake": "rope_pairing",
    "style": "Qwen-7B RotaryEmbedding: emb = repeat_interleave(freqs, 2) (interleaved tables) "
    "applied with _rotate_half",
}

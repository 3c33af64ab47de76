"""Preferred Networks PLaMo 2 attention mixer (modeling_plamo.py, the hybrid Mamba/attention
decoder): one fused `qkv_proj` split by `torch.split` into query, key and value widths, heads viewed
and transposed to (batch, heads, tokens, head_dim), per-head RMS normalisation by `_rms_norm` with
learned per-head gains `q_weight` / `k_weight` of shape (heads, head_dim), rotate_half RoPE at
`position_ids`, key/value heads repeated by `repeat_interleave`, torch SDPA with a boolean sliding-window
mask (`attention_window_size`) on layers not listed in `full_attention_idx`, `o_proj`. The decoder
layer wraps the mixer in PLaMo 2's four norms (pre_/post_ mixer and MLP).

This file: one bug: the rotary loop runs over (query, key, value): the values are rotated too."""

import torch
import torch.nn.functional as F
from torch import nn


class Plamo2Config:
    hidden_size = 64
    hidden_size_per_head = 16
    num_attention_heads = 4
    num_key_value_heads = 2
    attention_window_size = 8
    full_attention_idx = []
    rope_theta = 10000.0
    rms_norm_eps = 1e-6
    intermediate_size = 128
    num_hidden_layers = 1


def _rms_norm(hidden_states, weight, eps, offset=1.0):
    input_dtype = hidden_states.dtype
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + eps)
    hidden_states = hidden_states.to(input_dtype)
    if weight is not None:
        hidden_states = (offset + weight) * hidden_states
    return hidden_states


class RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6, offset=1.0):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.variance_epsilon = eps
        self.offset = offset

    def forward(self, hidden_states):
        return _rms_norm(hidden_states, self.weight, self.variance_epsilon, offset=self.offset)


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, base=10000.0):
        super().__init__()
        self.dim = dim
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x, seq_len):
        t = torch.arange(seq_len, dtype=torch.float64)
        freqs = torch.einsum("i,j->ij", t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos()[None, None].to(x.dtype), emb.sin()[None, None].to(x.dtype)


def _rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def _rotary_pos_emb(x, cos, sin, position_ids):
    # cos, sin: [1, 1, seq_len, dim] -> gathered at position_ids: [bs, 1, seq_len, dim]
    cos = cos.squeeze(1).squeeze(0)[position_ids].unsqueeze(1)
    sin = sin.squeeze(1).squeeze(0)[position_ids].unsqueeze(1)
    return (x * cos) + (_rotate_half(x) * sin)


def _swa_mask(q_len, kv_len, window_size, device):
    """Boolean mask, True where the query may attend: causal and at most window_size - 1 keys back."""
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    k_pos = torch.arange(kv_len, device=device)[None, :]
    return (k_pos <= q_pos) & (q_pos - k_pos < window_size)


def _causal_mask(q_len, kv_len, device):
    return torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril(diagonal=kv_len - q_len)


class Attention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        head_dim = config.hidden_size_per_head
        self.qk_dim = head_dim
        self.v_dim = head_dim
        self.q_num_heads = config.num_attention_heads
        self.k_num_heads = config.num_key_value_heads
        self.v_num_heads = config.num_key_value_heads
        self.q_proj_dim = self.q_num_heads * self.qk_dim
        self.k_proj_dim = self.k_num_heads * self.qk_dim
        self.v_proj_dim = self.v_num_heads * self.v_dim
        self.qkv_proj = nn.Linear(
            self.hidden_size, self.q_proj_dim + self.k_proj_dim + self.v_proj_dim, bias=False
        )
        self.o_proj = nn.Linear(self.q_num_heads * self.v_dim, self.hidden_size, bias=False)
        self.q_weight = nn.Parameter(torch.ones((self.q_num_heads, self.qk_dim)))
        self.k_weight = nn.Parameter(torch.ones((self.k_num_heads, self.qk_dim)))
        self.full_attn = layer_idx in config.full_attention_idx
        self.attention_window_size = config.attention_window_size
        self.rotary_emb = RotaryEmbedding(self.qk_dim, base=config.rope_theta)

    def forward(self, hidden_states, position_ids=None):
        bsz, q_len, _ = hidden_states.size()

        qkv = self.qkv_proj(hidden_states)
        query_states, key_states, value_states = torch.split(
            qkv, [self.q_proj_dim, self.k_proj_dim, self.v_proj_dim], dim=-1
        )
        query_states = query_states.view(bsz, q_len, self.q_num_heads, self.qk_dim).transpose(1, 2)
        key_states = key_states.view(bsz, q_len, self.k_num_heads, self.qk_dim).transpose(1, 2)
        value_states = value_states.view(bsz, q_len, self.v_num_heads, self.v_dim).transpose(1, 2)

        query_states = _rms_norm(query_states, None, 1e-6) * self.q_weight[None, :, None]
        key_states = _rms_norm(key_states, None, 1e-6) * self.k_weight[None, :, None]

        kv_len = key_states.shape[-2]
        cos, sin = self.rotary_emb(value_states, seq_len=kv_len)
        query_states, key_states, value_states = (
            _rotary_pos_emb(t, cos, sin, position_ids) for t in (query_states, key_states, value_states)
        )

        n_rep = self.q_num_heads // self.k_num_heads
        key_states = key_states.repeat_interleave(n_rep, dim=1)
        value_states = value_states.repeat_interleave(n_rep, dim=1)

        if self.full_attn:
            attn_mask = _causal_mask(q_len, kv_len, hidden_states.device)
        else:
            attn_mask = _swa_mask(q_len, kv_len, self.attention_window_size, hidden_states.device)
        attn_output = F.scaled_dot_product_attention(
            query_states, key_states, value_states, attn_mask=attn_mask[None, None]
        )
        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, self.q_num_heads * self.v_dim)
        return self.o_proj(attn_output)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, config.intermediate_size * 2, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class PlamoDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.mixer = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.pre_mixer_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, offset=1.0)
        self.post_mixer_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, offset=1.0 / 5)
        self.pre_mlp_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, offset=1.0)
        self.post_mlp_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, offset=1.0 / (5**1.5))

    def forward(self, hidden_states, position_ids=None):
        residual = hidden_states
        hidden_states = self.pre_mixer_norm(hidden_states)
        hidden_states = self.mixer(hidden_states, position_ids=position_ids)
        hidden_states = residual + self.post_mixer_norm(hidden_states)
        residual = hidden_states
        hidden_states = self.mlp(self.pre_mlp_norm(hidden_states))
        return residual + self.post_mlp_norm(hidden_states)


class Plamo2Decoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList([PlamoDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, inputs_embeds):
        seq_length = inputs_embeds.shape[1]
        position_ids = torch.arange(seq_length, dtype=torch.long, device=inputs_embeds.device)
        position_ids = position_ids.unsqueeze(0).expand(inputs_embeds.shape[0], -1)
        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_ids=position_ids)
        return self.norm(hidden_states)


def make_plamo2():
    torch.manual_seed(3450)
    model = Plamo2Decoder(Plamo2Config())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, RMSNorm):
                # effective gain (offset + weight) drawn from U(0.5, 1.5)
                mod.weight.uniform_(0.5, 1.5).sub_(mod.offset)
            if isinstance(mod, Attention):
                mod.q_weight.uniform_(0.5, 1.5)
                mod.k_weight.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {
    "target": "make_plamo2",
    "kind": "causal-multihead",
    "ok": False,
    "layer": "layers.0.mixer",
    "stage": "values",
    "mistake": "rope_on_values",
    "style": "PLaMo 2 Attention mixer: _rotary_pos_emb applied to q, k and v"
}

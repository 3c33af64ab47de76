"""ServiceNow Apriel (Mistral-style decoder): separate q/k/v projections, rotate_half RoPE,
repeat_kv, model-built sliding-window additive mask (q - window < kv <= q), eager softmax.

This file: one bug: the window test subtracts one more for the query itself: 7 keys visible for a declared window of 8."""

import torch
from torch import nn


class AprielConfig:
    hidden_size = 64
    intermediate_size = 128
    num_attention_heads = 4
    num_key_value_heads = 1
    rope_theta = 1000000.0
    rms_norm_eps = 1e-6
    attention_bias = False
    sliding_window = 8


class AprielRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.promote_types(input_dtype, torch.float32))
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return (self.weight * hidden_states).to(input_dtype)


class AprielRotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        dim = config.hidden_size // config.num_attention_heads
        self.base = config.rope_theta
        self.dim = dim

    @torch.no_grad()
    def forward(self, x, position_ids):
        inv_freq = 1.0 / (
            self.base ** (torch.arange(0, self.dim, 2, dtype=torch.float64, device=x.device) / self.dim)
        )
        freqs = position_ids[:, :, None].to(torch.float64) * inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class AprielAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(
            config.hidden_size, self.num_key_value_heads * self.head_dim, bias=config.attention_bias
        )
        self.v_proj = nn.Linear(
            config.hidden_size, self.num_key_value_heads * self.head_dim, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.attention_bias)
        self.sliding_window = config.sliding_window

    def forward(self, hidden_states, position_embeddings, attention_mask=None):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        query_states = self.q_proj(hidden_states)
        key_states = self.k_proj(hidden_states)
        value_states = self.v_proj(hidden_states)

        query_states = query_states.view(hidden_shape).transpose(1, 2)
        key_states = key_states.view(hidden_shape).transpose(1, 2)
        value_states = value_states.view(hidden_shape).transpose(1, 2)

        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)

        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.scaling
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        softmax_dtype = torch.promote_types(query_states.dtype, torch.float32)
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=softmax_dtype).to(query_states.dtype)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).contiguous()
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output)


class AprielMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class AprielDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = AprielAttention(config, layer_idx)
        self.mlp = AprielMLP(config)
        self.input_layernorm = AprielRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = AprielRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask=None):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = self.self_attn(hidden_states, position_embeddings, attention_mask=attention_mask)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.mlp(self.post_attention_layernorm(hidden_states))
        return residual + hidden_states


class AprielModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList([AprielDecoderLayer(config, 0)])
        self.norm = AprielRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = AprielRotaryEmbedding(config)
        self.sliding_window = config.sliding_window

    def _sliding_window_mask(self, seq_len, dtype, device):
        # Mistral-style: key kv visible to query q when q - sliding_window < kv <= q
        q_idx = torch.arange(seq_len, device=device)[:, None]
        kv_idx = torch.arange(seq_len, device=device)[None, :]
        allowed = kv_idx <= q_idx
        allowed = allowed & (q_idx - kv_idx < self.sliding_window - 1)
        mask = torch.zeros(seq_len, seq_len, dtype=dtype, device=device)
        mask = mask.masked_fill(~allowed, torch.finfo(dtype).min)
        return mask[None, None]

    def forward(self, inputs_embeds):
        seq_len = inputs_embeds.shape[1]
        position_ids = torch.arange(seq_len, device=inputs_embeds.device).unsqueeze(0)
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        attention_mask = self._sliding_window_mask(seq_len, inputs_embeds.dtype, inputs_embeds.device)
        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_embeddings, attention_mask=attention_mask)
        return self.norm(hidden_states)


def make_apriel_model():
    torch.manual_seed(3531)
    model = AprielModel(AprielConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, AprielRMSNorm):
                mod.weight.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {
    "target": "make_apriel_model",
    "kind": "causal-multihead",
    "ok": False,
    "layer": "layers.0.self_attn",
    "stage": "masked_scores",
    "mistake": "window_size",
    "style": (
        "ServiceNow Apriel AprielAttention: one bug: the window test subtracts one more "
        "for the query itself: 7 keys visible for a declared window of 8"
    ),
}


"""Liquid AI LFM2, attention layers as Hugging Face's Lfm2Attention writes them: separate
q/k/v projections without bias, a per-head RMSNorm on queries and keys (q_layernorm / k_layernorm,
applied on the [b, t, h, d] view before the transpose), rotate_half RoPE with cos/sin from the
model's rotary module, repeat_kv for grouped keys/values, additive causal mask from the model,
out_proj. The block is LFM2's pre-norm attention block (operator_norm, residual, ffn_norm, SwiGLU);
the short-convolution blocks of the hybrid are left out.

This file: one bug: the values are passed through apply_rotary_pos_emb too (copy of the q/k line)."""

import torch
from torch import nn


class Lfm2Config:
    hidden_size = 64
    intermediate_size = 128
    num_attention_heads = 4
    num_key_value_heads = 2
    rope_theta = 1000000.0
    norm_eps = 1e-5


class Lfm2RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states


class Lfm2RotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        dim = config.hidden_size // config.num_attention_heads
        exponent = torch.arange(0, dim, 2, dtype=torch.float64) / dim
        self.register_buffer("inv_freq", 1.0 / (config.rope_theta**exponent), persistent=False)

    @torch.no_grad()
    def forward(self, x, position_ids):
        freqs = position_ids[:, :, None].double() * self.inv_freq.double()[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


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


class Lfm2Attention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.is_causal = True
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.out_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=False)
        self.q_layernorm = Lfm2RMSNorm(self.head_dim, eps=config.norm_eps)
        self.k_layernorm = Lfm2RMSNorm(self.head_dim, eps=config.norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask=None):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        q = self.q_layernorm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        k = self.k_layernorm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        _, v = apply_rotary_pos_emb(q, v, cos, sin)

        k = repeat_kv(k, self.num_key_value_groups)
        v = repeat_kv(v, self.num_key_value_groups)

        attn_weights = torch.matmul(q, k.transpose(2, 3)) * self.scaling
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, v)
        attn_output = attn_output.transpose(1, 2).reshape(*input_shape, -1).contiguous()
        return self.out_proj(attn_output)


class Lfm2MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.w1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.w3 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class Lfm2AttentionDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = Lfm2Attention(config, layer_idx)
        self.feed_forward = Lfm2MLP(config)
        self.operator_norm = Lfm2RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.ffn_norm = Lfm2RMSNorm(config.hidden_size, eps=config.norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask=None):
        h = self.self_attn(self.operator_norm(hidden_states), position_embeddings, attention_mask)
        h = h + hidden_states
        return h + self.feed_forward(self.ffn_norm(h))


class Lfm2Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList([Lfm2AttentionDecoderLayer(config, 0)])
        self.pos_emb = Lfm2RotaryEmbedding(config)
        self.embedding_norm = Lfm2RMSNorm(config.hidden_size, eps=config.norm_eps)

    def forward(self, inputs_embeds):
        batch, seq_len, _ = inputs_embeds.shape
        dtype = inputs_embeds.dtype
        position_ids = torch.arange(seq_len, device=inputs_embeds.device).unsqueeze(0).expand(batch, -1)
        position_embeddings = self.pos_emb(inputs_embeds, position_ids)
        mask = torch.full((seq_len, seq_len), torch.finfo(dtype).min, dtype=dtype, device=inputs_embeds.device)
        mask = torch.triu(mask, diagonal=1)[None, None]
        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_embeddings, attention_mask=mask)
        return self.embedding_norm(hidden_states)


def make_lfm2():
    torch.manual_seed(2114)
    model = Lfm2Model(Lfm2Config())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, Lfm2RMSNorm):
                mod.weight.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {
    "target": "make_lfm2",
    "kind": "causal-multihead",
    "ok": False,
    "layer": "layers.0.self_attn",
    "stage": 'values',
    "mistake": 'rope_on_values',
    "style": 'LFM2 Lfm2Attention: apply_rotary_pos_emb reused on the values',
}

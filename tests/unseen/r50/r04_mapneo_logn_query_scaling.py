"""MAP-Neo (multimodal-art-projection / m-a-p) style decoder attention, written after the
Hugging Face Llama-architecture checkpoints that MAP-Neo ships (NeoForCausalLM-style layer names).
Eager core, 4 heads x 16 (num_key_value_heads = heads), rotate_half RoPE base 1e4, the model builds an
additive causal mask (triu of finfo.min) and hands it to the layer.

This file: refused: log-n scaling: each query is multiplied by max(1, log2(position + 1)), a position-dependent temperature."""

import math

import torch
import torch.nn.functional as F
from torch import nn


class NeoConfig:
    hidden_size = 64
    intermediate_size = 128
    num_attention_heads = 4
    num_key_value_heads = 4
    rope_theta = 10000.0
    rms_norm_eps = 1e-6
    sliding_window = None
    max_position_embeddings = 64


class NeoRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states


class NeoRotaryEmbedding(nn.Module):
    """cos/sin for rotate_half, computed in float64 on every call and cast."""

    def __init__(self, config):
        super().__init__()
        self.dim = config.hidden_size // config.num_attention_heads
        self.base = config.rope_theta

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


class NeoAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)


    def forward(self, hidden_states, position_embeddings, attention_mask=None):
        bsz, q_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)

        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)

        # log-n attention scaling: queries past the training length are sharpened by log(pos+1)/log(train_len)
        pos = torch.arange(1, q_len + 1, dtype=torch.float64, device=query_states.device)
        logn = (pos.log() / math.log(2.0)).clamp(min=1.0).to(query_states.dtype)
        query_states = query_states * logn[None, None, :, None]
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.scaling
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).contiguous().reshape(bsz, q_len, -1)
        return self.o_proj(attn_output)


class NeoMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class NeoDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = NeoAttention(config, layer_idx)
        self.mlp = NeoMLP(config)
        self.input_layernorm = NeoRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = NeoRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask=None):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = self.self_attn(hidden_states, position_embeddings, attention_mask)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.mlp(self.post_attention_layernorm(hidden_states))
        return residual + hidden_states


class NeoModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList([NeoDecoderLayer(config, 0)])
        self.norm = NeoRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = NeoRotaryEmbedding(config)

    def forward(self, inputs_embeds):
        bsz, seq_len, _ = inputs_embeds.shape
        device = inputs_embeds.device
        position_ids = torch.arange(seq_len, device=device).unsqueeze(0).expand(bsz, -1)
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        min_value = torch.finfo(inputs_embeds.dtype).min
        attention_mask = torch.full((seq_len, seq_len), min_value, dtype=inputs_embeds.dtype, device=device)
        attention_mask = torch.triu(attention_mask, diagonal=1)[None, None]
        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_embeddings, attention_mask)
        return self.norm(hidden_states)


def make_mapneo():
    torch.manual_seed(5001)
    model = NeoModel(NeoConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, NeoRMSNorm):
                mod.weight.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {'target': 'make_mapneo',
 'kind': 'causal-multihead',
 'ok': True,
 'layer': 'layers.0.self_attn',
 'unsupported': 'log-n (position-dependent) query scaling',
 'style': 'MAP-Neo (m-a-p) (r04): refused: Qwen-style logn attention with a 2-token training '
          'length (a configuration choice)'}

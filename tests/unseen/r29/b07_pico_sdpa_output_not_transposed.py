"""picotron (huggingface/picotron `picotron/model.py`) Llama Attention: separate q/k/v projections and
`out_proj`, per-rank `num_local_heads` (tensor-parallel world of 1), module-level `get_cos_sin`
tables held by the decoder layer, its own halves `apply_rotary_pos_emb` on [b, h, s, d],
`repeat_interleave` GQA, `causal = q.size(2) > 1`, SDPA or the flash_attn_func-layout path, `out_proj`.

This file: SDPA output [b, h, s, d] reshaped to [b, s, h*d] without the transpose(1, 2)."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class LlamaConfig:
    hidden_size = 64
    intermediate_size = 160
    num_attention_heads = 8
    num_key_value_heads = 2
    num_hidden_layers = 1
    max_position_embeddings = 128
    rope_theta = 500000.0
    rms_norm_eps = 1e-5
    use_flash_attention = False  # picotron's FLASH_ATTEN switch


class TensorParallelGroup:
    """Stand-in for picotron's process_group_manager: one rank, no sharding."""

    tp_world_size = 1


pgm = TensorParallelGroup()


def apply_rotary_pos_emb(x, cos, sin):
    # x: [batch_size, num_heads, seq_length, head_dim]
    batch_size, num_head, seq_length, head_dim = x.size()
    x1 = x[..., : head_dim // 2]
    x2 = x[..., head_dim // 2 :]
    rotate_half = torch.cat([-x2, x1], dim=-1)
    x = x * cos + rotate_half * sin
    return x


def get_cos_sin(seq_length, head_dim, base=500000.0):
    assert head_dim % 2 == 0
    theta = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float64) / head_dim))
    position = torch.arange(seq_length, dtype=torch.float64).unsqueeze(1)
    # [seq_length, head_dim // 2] repeated to [seq_length, head_dim]
    return torch.cos(position * theta).repeat(1, 2), torch.sin(position * theta).repeat(1, 2)


def flash_attention(q, k, v, causal=True):
    """CPU fallback with flash_attn_func's layout: q, k, v are [batch, seq, heads, head_dim]."""
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    seq_q, seq_k = q.size(2), k.size(2)
    scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.size(-1))
    if causal:
        keep = torch.ones(seq_q, seq_k, dtype=torch.bool, device=q.device).tril(diagonal=0)
        scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v).transpose(1, 2)


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states


class Attention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_key_values = config.num_key_value_heads
        self.head_dim = self.hidden_size // self.num_heads
        assert config.num_attention_heads % pgm.tp_world_size == 0
        assert config.num_key_value_heads % pgm.tp_world_size == 0
        self.num_local_heads = config.num_attention_heads // pgm.tp_world_size
        self.num_local_kv_heads = config.num_key_value_heads // pgm.tp_world_size
        self.use_flash_attention = config.use_flash_attention

        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_key_values * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_key_values * self.head_dim, bias=False)
        self.out_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.layer_idx = layer_idx

    def forward(self, x, cos, sin, attention_mask=None, position_ids=None):
        batch_size, seq_length, hidden_dim = x.size()
        q = self.q_proj(x)  # [batch_size, seq_length, num_heads*head_dim]
        k = self.k_proj(x)  # [batch_size, seq_length, num_key_values*head_dim]
        v = self.v_proj(x)  # [batch_size, seq_length, num_key_values*head_dim]

        q = q.view(batch_size, seq_length, self.num_local_heads, self.head_dim).transpose(1, 2)
        k = k.view(batch_size, seq_length, self.num_local_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(batch_size, seq_length, self.num_local_kv_heads, self.head_dim).transpose(1, 2)
        q = apply_rotary_pos_emb(q, cos, sin)
        k = apply_rotary_pos_emb(k, cos, sin)

        k = k.repeat_interleave(self.num_local_heads // self.num_local_kv_heads, dim=1)
        v = v.repeat_interleave(self.num_local_heads // self.num_local_kv_heads, dim=1)

        causal = q.size(2) > 1

        if not self.use_flash_attention:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        else:
            q = q.permute(0, 2, 1, 3)
            k = k.permute(0, 2, 1, 3)
            v = v.permute(0, 2, 1, 3)
            out = flash_attention(q, k, v, causal=causal)

        out = out.reshape(batch_size, seq_length, self.num_local_heads * self.head_dim)
        out = self.out_proj(out)
        return out


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attention = Attention(config, layer_idx=layer_idx)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = MLP(config)
        self.layer_idx = layer_idx
        head_dim = config.hidden_size // config.num_attention_heads
        cos, sin = get_cos_sin(config.max_position_embeddings, head_dim=head_dim, base=config.rope_theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x, attention_mask=None, position_ids=None):
        seq_length = x.size(1)
        cos = self.cos[:seq_length].to(x.dtype)
        sin = self.sin[:seq_length].to(x.dtype)
        x = x + self.attention(self.input_layernorm(x), cos, sin, attention_mask, position_ids)
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x


class Llama(nn.Module):
    """picotron's Llama body, fed with input embeddings."""

    def __init__(self, config):
        super().__init__()
        self.decoder_layers = nn.ModuleList(
            [DecoderLayer(config, layer_idx=i) for i in range(config.num_hidden_layers)]
        )
        self.final_norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, inputs_embeds, attention_mask=None, position_ids=None):
        x = inputs_embeds
        for layer in self.decoder_layers:
            x = layer(x, attention_mask, position_ids)
        return self.final_norm(x)


def make_picotron_llama():
    torch.manual_seed(2914)
    model = Llama(LlamaConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, LlamaRMSNorm):
                mod.weight.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {'target': 'make_picotron_llama',
 'kind': 'causal-multihead',
 'ok': False,
 'layer': 'decoder_layers.0.attention',
 'stage': 'output',
 'mistake': 'heads_merge',
 'style': 'picotron Attention (picotron/model.py): SDPA output [b, h, s, d] reshaped to [b, s, '
          'h*d] without the transpose(1, 2)'}

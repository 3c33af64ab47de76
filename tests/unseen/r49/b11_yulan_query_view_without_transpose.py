"""YuLan-Mini (RUC-GSAI) decoder attention, reduced to one layer.

YuLan-Mini is a Llama-architecture model (q/k/v/o projections, grouped-query heads, RMSNorm,
SwiGLU MLP, rotary position embedding; its long-context stage raised the rotary base). Written here
in the Hugging Face modeling style: the model builds the rotary tables (float64, cast at call time)
and the mask and hands both to the layer.

This file: one bug (base c04): the query is viewed straight to (bsz, heads, q_len, head_dim) without the transpose that keys and values get."""

import torch
from torch import nn
import torch.nn.functional as F


class YuLanMiniConfig:
    hidden_size = 64
    intermediate_size = 128
    num_attention_heads = 4
    num_key_value_heads = 2
    head_dim = 16
    rope_theta = 10000.0
    rms_norm_eps = 1e-6
    attention_bias = True
    sliding_window = None


class YuLanMiniRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class YuLanMiniRotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dim = config.head_dim
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
    hidden_states = hidden_states[:, :, None, :, :].expand(
        batch, num_key_value_heads, n_rep, slen, head_dim
    )
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class YuLanMiniAttention(nn.Module):
    def __init__(self, config, layer_idx=0):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
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

    def forward(self, hidden_states, position_embeddings, attention_mask=None):
        bsz, q_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states)
        key_states = self.k_proj(hidden_states)
        value_states = self.v_proj(hidden_states)

        query_states = query_states.view(bsz, self.num_heads, q_len, self.head_dim)
        key_states = key_states.view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        value_states = value_states.view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)

        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)

        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.scaling
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, value_states)

        attn_output = attn_output.transpose(1, 2).contiguous().reshape(bsz, q_len, -1)
        return self.o_proj(attn_output)


class YuLanMiniMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class YuLanMiniDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx=0):
        super().__init__()
        self.self_attn = YuLanMiniAttention(config, layer_idx)
        self.mlp = YuLanMiniMLP(config)
        self.input_layernorm = YuLanMiniRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = YuLanMiniRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask=None):
        residual = hidden_states
        hidden_states = self.self_attn(self.input_layernorm(hidden_states), position_embeddings, attention_mask)
        hidden_states = residual + hidden_states
        residual = hidden_states
        return residual + self.mlp(self.post_attention_layernorm(hidden_states))


class YuLanMiniModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList([YuLanMiniDecoderLayer(config, 0)])
        self.norm = YuLanMiniRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = YuLanMiniRotaryEmbedding(config)

    def forward(self, inputs_embeds):
        bsz, seq_len, _ = inputs_embeds.shape
        dtype, device = inputs_embeds.dtype, inputs_embeds.device
        # no padding here, but position ids follow the padding mask as in generate()
        padding_mask = torch.ones(bsz, seq_len, dtype=torch.long, device=device)
        position_ids = padding_mask.cumsum(-1) - 1
        position_ids = position_ids.masked_fill(padding_mask == 0, 1)
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        idx = torch.arange(seq_len, device=device)
        attention_mask = torch.full((seq_len, seq_len), torch.finfo(dtype).min, dtype=dtype, device=device)
        attention_mask = torch.triu(attention_mask, diagonal=1)[None, None]
        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_embeddings, attention_mask)
        return self.norm(hidden_states)


def make_yulan_mini():
    torch.manual_seed(4904)
    model = YuLanMiniModel(YuLanMiniConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, YuLanMiniRMSNorm):
                mod.weight.uniform_(0.5, 1.5)
            if isinstance(mod, nn.Linear) and mod.bias is not None:
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {   'target': 'make_yulan_mini',
    'kind': 'causal-multihead',
    'ok': False,
    'layer': 'layers.0.self_attn',
    'stage': 'queries',
    'mistake': 'heads_split',
    'style': 'YuLan-Mini (RUC-GSAI) (b11_query_view_without_transpose): (base c04) one bug: the '
             'query is viewed straight to (bsz, heads, q_len, head_dim) without the transpose that '
             'keys and values get'}

"""Moxin-7B (moxin-org) decoder attention, written the Mistral way the Moxin LLM uses: grouped-query
attention, rotate_half rotary, causal mask with a sliding window built by the model and handed to the
layer, eager (bmm) or SDPA core, bias-free q/k/v/o projections.

This file: refused: Gemma-2-style attention logit soft-capping (cap * tanh(scores / cap), cap 1.5) between the scale and the mask"""

import torch
import torch.nn.functional as F
from torch import nn


class MoxinConfig:
    hidden_size = 64
    intermediate_size = 128
    num_attention_heads = 4
    num_key_value_heads = 2
    rope_theta = 10000.0
    sliding_window = 6
    rms_norm_eps = 1e-5
    attn_implementation = "eager"
    attn_logit_softcapping = 1.5


class MoxinRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class MoxinRotaryEmbedding(nn.Module):
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


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(
        batch, num_key_value_heads, n_rep, slen, head_dim
    )
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class MoxinAttention(nn.Module):
    def __init__(self, config, layer_idx=0):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.sliding_window = config.sliding_window
        self.scaling = self.head_dim ** -0.5
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states, position_embeddings, attention_mask=None):
        bsz, q_len, _ = hidden_states.shape
        query_states = self.q_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        kv_len = key_states.shape[-2]

        cos, sin = position_embeddings
        # the table may be longer than the chunk (cached prefix): queries take its tail, keys its head
        q_cos, q_sin = cos[:, -q_len:].unsqueeze(1), sin[:, -q_len:].unsqueeze(1)
        k_cos, k_sin = cos[:, :kv_len].unsqueeze(1), sin[:, :kv_len].unsqueeze(1)
        query_states = query_states * q_cos + rotate_half(query_states) * q_sin
        key_states = key_states * k_cos + rotate_half(key_states) * k_sin

        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)

        if self.config.attn_implementation == "sdpa":
            attn_output = F.scaled_dot_product_attention(
                query_states,
                key_states,
                value_states,
                attn_mask=attention_mask,
                is_causal=attention_mask is None and q_len > 1,
                scale=self.scaling,
            )
        else:
            head_dim = query_states.shape[-1]
            q_flat = query_states.reshape(-1, q_len, head_dim)
            k_flat = key_states.reshape(-1, kv_len, head_dim)
            attn_weights = torch.bmm(q_flat, k_flat.transpose(1, 2)).view(bsz, self.num_heads, q_len, kv_len)
            attn_weights = attn_weights * self.scaling
            attn_weights = self.config.attn_logit_softcapping * torch.tanh(
                attn_weights / self.config.attn_logit_softcapping
            )
            if attention_mask is not None:
                attn_weights = attn_weights + attention_mask
            attn_weights = torch.softmax(attn_weights, dim=-1)
            attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, -1).contiguous()
        return self.o_proj(attn_output)


class MoxinMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoxinDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx=0):
        super().__init__()
        self.self_attn = MoxinAttention(config, layer_idx)
        self.mlp = MoxinMLP(config)
        self.input_layernorm = MoxinRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = MoxinRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask=None):
        residual = hidden_states
        hidden_states = self.self_attn(
            self.input_layernorm(hidden_states), position_embeddings, attention_mask=attention_mask
        )
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


def sliding_window_causal_mask(seq_len, sliding_window, dtype, device):
    """Additive (1, 1, q, k) mask: 0 where a query may look, dtype-min elsewhere."""
    q_idx = torch.arange(seq_len, device=device)[:, None]
    k_idx = torch.arange(seq_len, device=device)[None, :]
    allowed = k_idx <= q_idx
    if sliding_window is not None:
        allowed = allowed & (q_idx - k_idx < sliding_window)
    mask = torch.zeros(seq_len, seq_len, dtype=dtype, device=device)
    mask = mask.masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


class MoxinModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList([MoxinDecoderLayer(config, 0)])
        self.norm = MoxinRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = MoxinRotaryEmbedding(config)

    def forward(self, inputs_embeds, attention_mask=None):
        seq_len = inputs_embeds.shape[1]
        position_ids = torch.arange(seq_len, device=inputs_embeds.device).unsqueeze(0)
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        causal_mask = sliding_window_causal_mask(
            seq_len, self.config.sliding_window, inputs_embeds.dtype, inputs_embeds.device
        )
        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_embeddings, attention_mask=causal_mask)
        return self.norm(hidden_states)


def make_moxin_model():
    torch.manual_seed(4806)
    model = MoxinModel(MoxinConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, MoxinRMSNorm):
                mod.weight.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {'target': 'make_moxin_model',
 'kind': 'causal-multihead',
 'ok': True,
 'layer': 'layers.0.self_attn',
 'unsupported': 'logit_softcapping',
 'style': 'Moxin (moxin-org) (r01_moxin_logit_softcap): (base c06) refused: Gemma-2-style '
          'attention logit soft-capping (cap * tanh(scores / cap), cap 1.5) between the scale and '
          'the mask'}

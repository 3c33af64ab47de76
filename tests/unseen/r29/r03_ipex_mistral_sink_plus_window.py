"""ipex-llm (intel-analytics `ipex_llm/transformers/models/mistral.py`) Mistral attention as ipex-llm
patches it: `mistral_attention_forward_original` without the XPU kernels: q/k/v_proj, view/transpose,
`self.rotary_emb(value_states, seq_len=kv_seq_len)` + `apply_rotary_pos_emb(..., position_ids,
"mistral")` (rotate_half), `repeat_kv`, `use_sdp_causal` fast path or eager matmul / sqrt(head_dim) +
additive sliding-window mask + fp32-upcast softmax, `invalidInputError` shape checks, `o_proj`.

This file: refused: LM-Infinite / StreamingLLM Λ-shaped mask (attention_sink_size 2): the first 2 tokens stay visible to every query on top of the sliding window of 8."""

import math
from typing import Optional, Tuple

import torch
from torch import nn
import torch.nn.functional as F


class MistralConfig:
    hidden_size = 64
    intermediate_size = 160
    num_attention_heads = 4
    num_key_value_heads = 2
    num_hidden_layers = 1
    max_position_embeddings = 256
    rope_theta = 1000000.0
    rms_norm_eps = 1e-5
    sliding_window = 8
    attention_sink_size = 2  # LM-Infinite / StreamingLLM style: first tokens always visible


def invalidInputError(condition, errMsg):
    if not condition:
        raise RuntimeError(errMsg)


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids, model_family):
    # ipex_llm.transformers.models.utils.apply_rotary_pos_emb, the non-fused branch
    if model_family in ["llama", "mistral", "mixtral", "qwen2"]:
        cos = cos[position_ids].unsqueeze(1)  # [bs, 1, seq_len, dim]
        sin = sin[position_ids].unsqueeze(1)
        q_embed = (q * cos) + (rotate_half(q) * sin)
        k_embed = (k * cos) + (rotate_half(k) * sin)
        return q_embed, k_embed
    invalidInputError(False, f"{model_family} is not supported.")


def use_sdp_causal(q_len, kv_len, attention_mask):
    # fast path: a plain causal prefill can skip the materialised mask
    return q_len == kv_len and attention_mask is None


class MistralRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states


class MistralRotaryEmbedding(nn.Module):
    def __init__(self, dim, max_position_embeddings=2048, base=10000):
        super().__init__()
        self.dim = dim
        self.base = base
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2, dtype=torch.float64) / self.dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._set_cos_sin_cache(max_position_embeddings)

    def _set_cos_sin_cache(self, seq_len):
        self.max_seq_len_cached = seq_len
        t = torch.arange(self.max_seq_len_cached, dtype=torch.float64)
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def forward(self, x, seq_len=None):
        return (self.cos_cached[:seq_len].to(dtype=x.dtype), self.sin_cached[:seq_len].to(dtype=x.dtype))


class MistralAttention(nn.Module):
    def __init__(self, config: MistralConfig, layer_idx: int = 0):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=False)
        self.rotary_emb = MistralRotaryEmbedding(
            self.head_dim, max_position_embeddings=config.max_position_embeddings, base=config.rope_theta
        )

    def forward(self, hidden_states, attention_mask=None, position_ids=None):
        """mistral_attention_forward_original, without the xpu fused kernels."""
        bsz, q_len, hidden_size = hidden_states.size()

        query_states = self.q_proj(hidden_states)
        key_states = self.k_proj(hidden_states)
        value_states = self.v_proj(hidden_states)

        query_states = query_states.view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = key_states.view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        value_states = value_states.view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)

        kv_seq_len = key_states.shape[-2]
        cos, sin = self.rotary_emb(value_states, seq_len=kv_seq_len)
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin,
                                                        position_ids, "mistral")

        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)

        if use_sdp_causal(q_len, kv_seq_len, attention_mask):
            attn_output = F.scaled_dot_product_attention(query_states, key_states, value_states, is_causal=True)
        else:
            attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(self.head_dim)
            invalidInputError(attn_weights.size() == (bsz, self.num_heads, q_len, kv_seq_len),
                              "Attention weights have the wrong size")
            if attention_mask is not None:
                invalidInputError(attention_mask.size() == (bsz, 1, q_len, kv_seq_len),
                                  "Attention mask has the wrong size")
                attn_weights = attn_weights + attention_mask
            # upcast half-precision attention to fp32
            upcast = torch.float32 if query_states.dtype in (torch.float16, torch.bfloat16) else None
            attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=upcast).to(query_states.dtype)
            attn_output = torch.matmul(attn_weights, value_states)

        attn_output = attn_output.transpose(1, 2).contiguous()
        attn_output = attn_output.reshape(bsz, q_len, self.hidden_size)
        return self.o_proj(attn_output)


def _prepare_4d_sliding_window_mask(bsz, tgt_len, dtype, device, sliding_window, sink_size=0):
    """Additive [bsz, 1, tgt_len, tgt_len] mask: causal, keys older than the window hidden."""
    i = torch.arange(tgt_len, device=device)[:, None]
    j = torch.arange(tgt_len, device=device)[None, :]
    visible = j <= i
    if sliding_window is not None:
        in_window = (i - j) < sliding_window
        if sink_size:
            in_window = in_window | (j < sink_size)
        visible = visible & in_window
    mask = torch.zeros(tgt_len, tgt_len, dtype=dtype, device=device)
    mask = mask.masked_fill(~visible, torch.finfo(dtype).min)
    return mask[None, None].expand(bsz, 1, tgt_len, tgt_len)


class MistralMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MistralDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = MistralAttention(config, layer_idx)
        self.mlp = MistralMLP(config)
        self.input_layernorm = MistralRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = MistralRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None, position_ids=None):
        residual = hidden_states
        hidden_states = self.self_attn(self.input_layernorm(hidden_states), attention_mask, position_ids)
        hidden_states = residual + hidden_states
        residual = hidden_states
        return residual + self.mlp(self.post_attention_layernorm(hidden_states))


class MistralModel(nn.Module):
    """HF MistralModel as patched by ipex-llm (mistral_model_forward), fed with embeddings."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList([MistralDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = MistralRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, inputs_embeds):
        bsz, seq_length, _ = inputs_embeds.shape
        position_ids = torch.arange(seq_length, device=inputs_embeds.device).unsqueeze(0).expand(bsz, -1)
        attention_mask = _prepare_4d_sliding_window_mask(
            bsz, seq_length, inputs_embeds.dtype, inputs_embeds.device,
            self.config.sliding_window, self.config.attention_sink_size,
        )
        hidden_states = inputs_embeds
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(hidden_states, attention_mask, position_ids)
        return self.norm(hidden_states)


def make_ipex_mistral():
    torch.manual_seed(2949)
    model = MistralModel(MistralConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, MistralRMSNorm):
                mod.weight.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {'target': 'make_ipex_mistral',
 'kind': 'causal-multihead',
 'ok': True,
 'layer': 'layers.0.self_attn',
 'unsupported': 'sink_window_mask',
 'style': 'ipex-llm Mistral attention (models/mistral.py): refused: LM-Infinite / StreamingLLM '
          'Λ-shaped mask (attention_sink_size 2): the first 2 tokens stay visible to every query '
          'on top of the sliding window of 8'}

"""Qwen3-VL language tower used on text alone, after transformers' modeling_qwen3_vl.py.

Qwen3VLForConditionalGeneration with no visual inputs: model.language_model (Qwen3VLTextModel:
embed_tokens, layers.N, norm, rotary_emb) and lm_head.  Qwen3VLTextAttention: q_proj/k_proj/v_proj/o_proj
without bias, per-head RMSNorm q_norm/k_norm (over head_dim, before the rotary), GQA 4/2 through
repeat_kv, interleaved M-RoPE: Qwen3VLTextRotaryEmbedding builds freqs for the (3, b, s) position
streams and apply_interleaved_mrope takes frequency j from stream j % 3 within mrope_section [4, 2, 2]
(here all three streams hold 0..n-1, so it is plain rotate_half rotary, base 5e6).  Eager attention:
matmul * scaling, finfo.min additive causal mask, float32 softmax for float32 inputs.
Slip: layer 2 is built with `attn_implementation="eager_where"`, a variant that applies the boolean
causal mask with `torch.where(mask, scores, 0.0)` ("zero the future scores") instead of adding the
finfo.min mask, so future keys keep weight exp(0).  Other layers use the additive mask.
No cache is used here: `model(ids)` returns an object with `.logits`.
"""

from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": [
        "model.language_model.layers.0.self_attn",
        "model.language_model.layers.1.self_attn",
        "model.language_model.layers.2.self_attn",
    ],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "model.language_model.layers.2.self_attn",
    "stage": "masked_scores",
    "mistake": "mask_fill_value",
    "style": "modeling_qwen3_vl.py text path: per-head q_norm/k_norm before interleaved M-RoPE (mrope_section [4, 2, 2], "
    "text positions) rotate_half base 5e6, GQA 4/2 repeat_kv, no bias; layer 2's eager_where variant fills masked "
    "scores with 0.0 via torch.where instead of adding finfo.min",
}


class Qwen3VLTextRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32) if input_dtype != torch.float64 else hidden_states
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class Qwen3VLTextRotaryEmbedding(nn.Module):
    def __init__(self, head_dim, base, mrope_section):
        super().__init__()
        self.head_dim = head_dim
        self.base = base
        self.mrope_section = mrope_section

    def apply_interleaved_mrope(self, freqs, mrope_section):
        # freqs: (3, b, s, d/2) -> (b, s, d/2); frequency j comes from stream j % 3 (T, H, W interleaved)
        freqs_t = freqs[0].clone()
        for dim, offset in enumerate((1, 2), start=1):
            length = mrope_section[dim] * 3
            idx = slice(offset, length, 3)
            freqs_t[..., idx] = freqs[dim, ..., idx]
        return freqs_t

    @torch.no_grad()
    def forward(self, x, position_ids):
        inv_freq = 1.0 / (
            self.base ** (torch.arange(0, self.head_dim, 2, dtype=torch.float64, device=x.device) / self.head_dim)
        )
        inv_freq_expanded = inv_freq[None, None, :, None].expand(3, position_ids.shape[1], -1, 1)
        position_ids_expanded = position_ids[:, :, None, :].to(torch.float64)
        freqs = (inv_freq_expanded @ position_ids_expanded).transpose(2, 3)
        freqs = self.apply_interleaved_mrope(freqs, self.mrope_section)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class Qwen3VLTextAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attn_implementation = config.layer_attn_implementation[layer_idx]
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.q_norm = Qwen3VLTextRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3VLTextRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask=None, bool_mask=None):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.scaling
        if self.attn_implementation == "eager_where":
            attn_weights = torch.where(bool_mask, attn_weights, torch.zeros_like(attn_weights))
        elif attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        softmax_dtype = torch.float32 if query_states.dtype != torch.float64 else torch.float64
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=softmax_dtype).to(query_states.dtype)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights


class Qwen3VLTextMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen3VLTextDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = Qwen3VLTextAttention(config, layer_idx)
        self.mlp = Qwen3VLTextMLP(config)
        self.input_layernorm = Qwen3VLTextRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3VLTextRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask, bool_mask, position_embeddings):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(
            hidden_states,
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            bool_mask=bool_mask,
        )
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.mlp(self.post_attention_layernorm(hidden_states))
        return residual + hidden_states


class Qwen3VLTextModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [Qwen3VLTextDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = Qwen3VLTextRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3VLTextRotaryEmbedding(
            config.head_dim, config.rope_theta, config.rope_scaling["mrope_section"]
        )

    def forward(self, input_ids):
        inputs_embeds = self.embed_tokens(input_ids)
        bsz, seq_len = input_ids.shape
        cache_position = torch.arange(seq_len, device=input_ids.device)
        position_ids = cache_position.view(1, 1, -1).expand(3, bsz, -1)
        dtype = inputs_embeds.dtype
        allowed = cache_position[None, :] <= cache_position[:, None]
        causal_mask = torch.zeros(seq_len, seq_len, dtype=dtype, device=input_ids.device)
        causal_mask = causal_mask.masked_fill(~allowed, torch.finfo(dtype).min)[None, None]
        bool_mask = allowed[None, None]
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(hidden_states, causal_mask, bool_mask, position_embeddings)
        return self.norm(hidden_states)


class Qwen3VLModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.language_model = Qwen3VLTextModel(config)


class Qwen3VLForConditionalGeneration(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = Qwen3VLModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids):
        hidden = self.model.language_model(input_ids)
        return SimpleNamespace(logits=self.lm_head(hidden))


def make_model():
    torch.manual_seed(1706)
    config = SimpleNamespace(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=5e6,
        rms_norm_eps=1e-6,
        rope_scaling={"mrope_interleaved": True, "mrope_section": [4, 2, 2]},
        layer_attn_implementation=["eager", "eager", "eager_where"],
    )
    model = Qwen3VLForConditionalGeneration(config)
    g = torch.Generator().manual_seed(17061)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, Qwen3VLTextRMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
            if isinstance(m, nn.Linear) and m.bias is not None:
                m.bias.copy_(0.2 * torch.randn(m.bias.shape, generator=g))
    return model.eval()

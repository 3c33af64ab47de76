"""HF PaliGemma language model (Gemma 1 GemmaAttention, MQA) with PaliGemma's prefix-LM mask: the image
tokens and the text prompt (the "prefix", token_type_ids == 0) attend to each other bidirectionally,
only the suffix (token_type_ids == 1) is causal. The model builds the additive mask from token types
and passes it to the layer.

This file: refused (the prefix block is neither causal nor bidirectional attention)."""

import torch
from torch import nn


class PaliGemmaTextConfig:
    hidden_size = 64
    intermediate_size = 128
    num_attention_heads = 4
    num_key_value_heads = 1
    head_dim = 16
    rope_theta = 10000.0
    rms_norm_eps = 1e-6
    num_image_tokens = 4
    prompt_tokens = 4


class GemmaRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return out * (1.0 + self.weight)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class GemmaAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv = config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states, position_embeddings, attention_mask):
        bsz, q_len, _ = hidden_states.shape
        shape = (bsz, q_len, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        cos, sin = position_embeddings
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k = k.expand(bsz, self.num_heads, q_len, self.head_dim)
        v = v.expand(bsz, self.num_heads, q_len, self.head_dim)
        w = torch.matmul(q, k.transpose(2, 3)) * self.scaling + attention_mask
        w = torch.softmax(w, dim=-1)
        out = torch.matmul(w, v).transpose(1, 2).reshape(bsz, q_len, -1)
        return self.o_proj(out)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = GemmaAttention(config)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x, position_embeddings, attention_mask):
        x = x + self.self_attn(self.input_layernorm(x), position_embeddings, attention_mask)
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(
            nn.functional.gelu(self.gate_proj(h), approximate="tanh") * self.up_proj(h)
        )


class PaliGemmaLanguageModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList([GemmaDecoderLayer(config)])
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        inv_freq = 1.0 / (
            config.rope_theta
            ** (torch.arange(0, config.head_dim, 2, dtype=torch.float64) / config.head_dim)
        )
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _update_causal_mask(self, token_type_ids, dtype):
        seq_len = token_type_ids.shape[1]
        min_dtype = torch.finfo(dtype).min
        causal_mask = torch.full(
            (seq_len, seq_len), min_dtype, dtype=dtype, device=token_type_ids.device
        )
        causal_mask = torch.triu(causal_mask, diagonal=1)
        causal_mask = causal_mask[None, None].expand(token_type_ids.shape[0], 1, -1, -1).clone()
        # prefix tokens (image + prompt) see the whole prefix
        is_prefix = token_type_ids == 0
        both_prefix = is_prefix[:, None, :, None] & is_prefix[:, None, None, :]
        return causal_mask.masked_fill(both_prefix, 0.0)

    def forward(self, inputs_embeds):
        bsz, seq_len, _ = inputs_embeds.shape
        prefix = self.config.num_image_tokens + self.config.prompt_tokens
        token_type_ids = (
            (torch.arange(seq_len, device=inputs_embeds.device) >= prefix)
            .long()[None]
            .expand(bsz, -1)
        )
        mask = self._update_causal_mask(token_type_ids, inputs_embeds.dtype)
        pos = torch.arange(seq_len, device=inputs_embeds.device, dtype=torch.float64)
        freqs = pos[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[None]
        pe = (emb.cos().to(inputs_embeds.dtype), emb.sin().to(inputs_embeds.dtype))
        h = inputs_embeds * (self.config.hidden_size**0.5)
        for layer in self.layers:
            h = layer(h, pe, mask)
        return self.norm(h)


def make_paligemma_lm():
    torch.manual_seed(1551)
    model = PaliGemmaLanguageModel(PaliGemmaTextConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, GemmaRMSNorm):
                mod.weight.uniform_(-0.5, 0.5)
    return model.eval()


EXPECT = {
    "target": "make_paligemma_lm",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "layers.0.self_attn",
    "unsupported": "prefix_lm_mask",
    "style": "HF PaliGemma language model: Gemma MQA attention with the prefix-LM mask built from "
    "token_type_ids (the first 8 tokens, image + prompt, attend bidirectionally, the suffix is causal)",
}

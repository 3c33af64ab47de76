"""SmolLM3 in the shape of transformers' modeling_smollm3.py (written from memory, in my own words):
Llama layout whose `config.no_rope_layers` switches the rotary off on every fourth layer (here
[1, 1, 1, 0]: layers 0-2 rotate, layer 3 is NoPE), GQA 4 heads / 2 kv heads of 16, rotate_half base
2e6, no biases, RMSNorm, SwiGLU, tied embeddings, eager attention with an additive finfo.min mask
computed from the past length.  4 layers.

Cache (hf): out = model(prompt, use_cache=True); out = model(tok, past_key_values=out.past_key_values,
use_cache=True).  past_key_values is a tuple per layer of (key, value) in the flash-attention layout
(batch, seq, kv_heads, head_dim), keys stored rotated; the past length is read from dim 1.

Slip (decoding only): the attention stores its present with `.transpose(1, 2)` into the flash
layout but reads the past back with `.view(bsz, kv_heads, -1, head_dim)` instead of transposing,
which scrambles cached keys and values across heads and positions once the cache holds two or more
tokens.  Decode: `cache_other`, step 0 (prompts of 2+ tokens), `model.layers.0.self_attn`.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": [
        "model.layers.0.self_attn",
        "model.layers.1.self_attn",
        "model.layers.2.self_attn",
        "model.layers.3.self_attn",
    ],
    "kind": "causal-multihead",
    "cache": "hf",
    "decode": {"mistake": "cache_other", "step": 0, "layer": "model.layers.0.self_attn"},
    "style": "modeling_smollm3.py: no_rope_layers (layer 3 NoPE), GQA 4/2, rope 2e6, tied head, tuple cache in "
    "(b, s, kv, d) layout; slip: past read back with view instead of transpose",
}


class SmolLM3Config:
    vocab_size = 170
    hidden_size = 64
    intermediate_size = 96
    num_hidden_layers = 4
    num_attention_heads = 4
    num_key_value_heads = 2
    rope_theta = 2000000.0
    rms_norm_eps = 1e-6
    no_rope_layer_interval = 4

    @property
    def no_rope_layers(self):
        return [
            int((i + 1) % self.no_rope_layer_interval != 0) for i in range(self.num_hidden_layers)
        ]


class SmolLM3RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class SmolLM3RotaryEmbedding(nn.Module):
    def __init__(self, dim, base):
        super().__init__()
        self.register_buffer(
            "inv_freq",
            1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)),
            persistent=False,
        )

    def forward(self, x, position_ids):
        freqs = position_ids[:, :, None].double() * self.inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    hidden_states = hidden_states[:, :, None, :, :].expand(
        batch, num_key_value_heads, n_rep, slen, head_dim
    )
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class SmolLM3Attention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(
            config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False
        )
        self.v_proj = nn.Linear(
            config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False
        )
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.use_rope = config.no_rope_layers[layer_idx]

    def forward(
        self, hidden_states, position_embeddings, attention_mask, layer_past=None, use_cache=False
    ):
        bsz, q_len, _ = hidden_states.shape
        hidden_shape = (bsz, q_len, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        if self.use_rope:
            cos, sin = position_embeddings
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
            query_states = query_states * cos + rotate_half(query_states) * sin
            key_states = key_states * cos + rotate_half(key_states) * sin
        if layer_past is not None:
            past_key = layer_past[0].view(bsz, self.num_key_value_heads, -1, self.head_dim)
            past_value = layer_past[1].view(bsz, self.num_key_value_heads, -1, self.head_dim)
            key_states = torch.cat([past_key, key_states], dim=2)
            value_states = torch.cat([past_value, value_states], dim=2)
        present = None
        if use_cache:
            present = (
                key_states.transpose(1, 2).contiguous(),
                value_states.transpose(1, 2).contiguous(),
            )
        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.scaling
        attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_output = (
            torch.matmul(attn_weights, value_states).transpose(1, 2).reshape(bsz, q_len, -1)
        )
        return self.o_proj(attn_output), present


class SmolLM3MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SmolLM3DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = SmolLM3Attention(config, layer_idx)
        self.mlp = SmolLM3MLP(config)
        self.input_layernorm = SmolLM3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = SmolLM3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask, layer_past, use_cache):
        residual = hidden_states
        hidden_states, present = self.self_attn(
            self.input_layernorm(hidden_states),
            position_embeddings,
            attention_mask,
            layer_past,
            use_cache,
        )
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states)), present


class SmolLM3Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [SmolLM3DecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = SmolLM3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = SmolLM3RotaryEmbedding(
            config.hidden_size // config.num_attention_heads, config.rope_theta
        )

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        bsz, seq_len = input_ids.shape
        past_length = past_key_values[0][0].shape[1] if past_key_values is not None else 0
        inputs_embeds = self.embed_tokens(input_ids)
        cache_position = torch.arange(past_length, past_length + seq_len)
        position_ids = cache_position.unsqueeze(0)
        dtype = inputs_embeds.dtype
        target = past_length + seq_len
        mask = torch.zeros(seq_len, target, dtype=dtype)
        mask = mask.masked_fill(
            torch.arange(target)[None, :] > cache_position[:, None], torch.finfo(dtype).min
        )
        mask = mask[None, None]
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        hidden_states = inputs_embeds
        presents = ()
        for i, decoder_layer in enumerate(self.layers):
            layer_past = past_key_values[i] if past_key_values is not None else None
            hidden_states, present = decoder_layer(
                hidden_states, position_embeddings, mask, layer_past, use_cache
            )
            presents = presents + (present,)
        return self.norm(hidden_states), (presents if use_cache else None)


class CausalLMOutputWithPast:
    def __init__(self, logits, past_key_values):
        self.logits = logits
        self.past_key_values = past_key_values


class SmolLM3ForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = SmolLM3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        hidden_states, presents = self.model(input_ids, past_key_values, use_cache)
        return CausalLMOutputWithPast(self.lm_head(hidden_states), presents)


def make_model():
    torch.manual_seed(6616)
    model = SmolLM3ForCausalLM(SmolLM3Config())
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(0.4)
        for m in model.modules():
            if isinstance(m, SmolLM3RMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn_like(m.weight))
    return model.eval()

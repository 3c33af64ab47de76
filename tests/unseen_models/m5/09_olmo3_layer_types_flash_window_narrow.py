"""OLMo-3 in the shape of transformers' modeling_olmo3.py (written from memory, in my own words):
no pre-norm; RMSNorm after each sublayer (post_attention_layernorm, post_feedforward_layernorm), QK
norm over the whole projection (`q_norm` over heads x head_dim, `k_norm` likewise) before the head
split, rotate_half rotary base 500000, 4 heads of 16 (MHA), SwiGLU MLP.  `config.layer_types` is
[sliding_attention, sliding_attention, full_attention] with sliding_window = 4 (a query sees itself
and the 3 keys before it); each sliding layer keeps `self.sliding_window = 4`, the full layer None.
The model builds one mask per layer type (causal, and causal & q - k < 4).

Layer 1 is configured with `attn_backend = "flash_emulated"`: it ignores the model's mask and
builds its own band from flash-attention's window_size=(sliding_window - 1, 0) left count, but
tests `q - k < left` instead of `q - k <= left`, so each query sees only 3 keys.  No cache.

Slip: `model.layers.1.self_attn` applies a sliding window of 3 instead of the declared 4 (stage
`masked_scores`, `window_size`).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["model.layers.0.self_attn", "model.layers.1.self_attn", "model.layers.2.self_attn"],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "model.layers.1.self_attn",
    "stage": "masked_scores",
    "mistake": "window_size",
    "style": "modeling_olmo3.py: post-sublayer norms, full-projection q_norm/k_norm, rope base 5e5, layer_types "
    "sliding/sliding/full (window 4); slip: layer 1's flash-emulation band is off by one (3 keys)",
}


class Olmo3Config:
    vocab_size = 160
    hidden_size = 64
    intermediate_size = 112
    num_hidden_layers = 3
    num_attention_heads = 4
    num_key_value_heads = 4
    rope_theta = 500000.0
    rms_norm_eps = 1e-6
    sliding_window = 4
    layer_types = ["sliding_attention", "sliding_attention", "full_attention"]
    attn_backend = ["eager", "flash_emulated", "eager"]


class Olmo3RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class Olmo3RotaryEmbedding(nn.Module):
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


class Olmo3Attention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(
            config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False
        )
        self.v_proj = nn.Linear(
            config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False
        )
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.q_norm = Olmo3RMSNorm(self.num_heads * self.head_dim, config.rms_norm_eps)
        self.k_norm = Olmo3RMSNorm(config.num_key_value_heads * self.head_dim, config.rms_norm_eps)
        self.attention_type = config.layer_types[layer_idx]
        self.sliding_window = (
            config.sliding_window if self.attention_type == "sliding_attention" else None
        )
        self.backend = config.attn_backend[layer_idx]

    def flash_band(self, q_len, k_len, device):
        left = self.sliding_window - 1  # flash-attn window_size=(left, 0)
        q_idx = torch.arange(k_len - q_len, k_len, device=device)[:, None]
        kv_idx = torch.arange(k_len, device=device)[None, :]
        return (kv_idx <= q_idx) & (q_idx - kv_idx < left)

    def forward(self, hidden_states, position_embeddings, attention_mask):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_norm(self.q_proj(hidden_states))
        key_states = self.k_norm(self.k_proj(hidden_states))
        value_states = self.v_proj(hidden_states)
        query_states = query_states.view(hidden_shape).transpose(1, 2)
        key_states = key_states.view(hidden_shape).transpose(1, 2)
        value_states = value_states.view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        query_states = query_states * cos + rotate_half(query_states) * sin
        key_states = key_states * cos + rotate_half(key_states) * sin
        scores = torch.matmul(query_states, key_states.transpose(2, 3)) * self.scaling
        if self.backend == "flash_emulated" and self.sliding_window is not None:
            allowed = self.flash_band(query_states.shape[2], key_states.shape[2], scores.device)
        else:
            allowed = attention_mask
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        attn_weights = F.softmax(scores, dim=-1)
        attn_output = (
            torch.matmul(attn_weights, value_states).transpose(1, 2).reshape(*input_shape, -1)
        )
        return self.o_proj(attn_output), attn_weights


class Olmo3MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Olmo3DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = Olmo3Attention(config, layer_idx)
        self.mlp = Olmo3MLP(config)
        self.post_attention_layernorm = Olmo3RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = Olmo3RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask):
        residual = hidden_states
        hidden_states, _ = self.self_attn(hidden_states, position_embeddings, attention_mask)
        hidden_states = residual + self.post_attention_layernorm(hidden_states)
        residual = hidden_states
        return residual + self.post_feedforward_layernorm(self.mlp(hidden_states))


class Olmo3Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [Olmo3DecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = Olmo3RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = Olmo3RotaryEmbedding(
            config.hidden_size // config.num_attention_heads, config.rope_theta
        )

    def forward(self, input_ids):
        bsz, seq_len = input_ids.shape
        hidden_states = self.embed_tokens(input_ids)
        position_ids = torch.arange(seq_len).unsqueeze(0).expand(bsz, -1)
        q_idx = torch.arange(seq_len)[:, None]
        kv_idx = torch.arange(seq_len)[None, :]
        causal = kv_idx <= q_idx
        causal_mask_mapping = {
            "full_attention": causal,
            "sliding_attention": causal & (q_idx - kv_idx < self.config.sliding_window),
        }
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for decoder_layer in self.layers:
            mask = causal_mask_mapping[decoder_layer.self_attn.attention_type]
            hidden_states = decoder_layer(hidden_states, position_embeddings, mask)
        return self.norm(hidden_states)


class CausalLMOutputWithPast:
    def __init__(self, logits):
        self.logits = logits


class Olmo3ForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = Olmo3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids):
        return CausalLMOutputWithPast(self.lm_head(self.model(input_ids)))


def make_model():
    torch.manual_seed(5909)
    model = Olmo3ForCausalLM(Olmo3Config())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, Olmo3RMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn_like(m.weight))
    return model.eval()

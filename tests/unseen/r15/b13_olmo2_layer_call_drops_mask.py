"""HF OLMo 2 (Olmo2Attention) with a split-KV attention core: keys/values cut into two slices, each
slice's softmax output and log-sum-exp computed separately, then merged exactly by
exp(lse_i - logsumexp(lse)) (flash-decoding style). Full-width q_norm/k_norm RMSNorm on the
projections before the head split, rotate_half RoPE, model-built additive causal mask, OLMo 2's
post-norm block (post_attention_layernorm on the attention output).

This file: one bug: Olmo2Model calls layer(hidden_states, position_embeddings) without attention_mask=, so the split-KV core runs unmasked."""

import torch
from torch import nn


class Olmo2Config:
    hidden_size = 64
    intermediate_size = 128
    num_attention_heads = 4
    num_key_value_heads = 4
    rope_theta = 500000.0
    rms_norm_eps = 1e-6
    num_kv_splits = 2  # split-KV ("flash-decoding") partial attention, merged by log-sum-exp


class Olmo2RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return (self.weight * hidden_states).to(input_dtype)


class Olmo2RotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        dim = config.hidden_size // config.num_attention_heads
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x, position_ids):
        freqs = position_ids[:, :, None].to(torch.float64) * self.inv_freq[None, None, :]
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
    hidden_states = hidden_states[:, :, None, :, :].expand(
        batch, num_key_value_heads, n_rep, slen, head_dim
    )
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


def partial_attention(query, key, value, scaling, mask):
    """Attention over one slice of the keys: returns the slice's normalised output and its
    log-sum-exp, so slices can be merged exactly afterwards."""
    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling
    if mask is not None:
        scores = scores + mask
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    out = torch.matmul(torch.softmax(scores, dim=-1), value)
    return out, lse


def split_kv_attention(query, key, value, scaling, attention_mask, num_splits):
    k_len = key.shape[2]
    bounds = [round(i * k_len / num_splits) for i in range(num_splits + 1)]
    outs, lses = [], []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        if hi <= lo:
            continue
        mask = attention_mask[..., lo:hi] if attention_mask is not None else None
        out, lse = partial_attention(query, key[:, :, lo:hi], value[:, :, lo:hi], scaling, mask)
        outs.append(out)
        lses.append(lse)
    lse_total = torch.logsumexp(torch.stack(lses, dim=0), dim=0)
    merged = torch.zeros_like(outs[0])
    for out, lse in zip(outs, lses):
        merged = merged + torch.exp(lse - lse_total) * out
    return merged


class Olmo2Attention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(
            config.hidden_size, config.num_attention_heads * self.head_dim, bias=False
        )
        self.k_proj = nn.Linear(
            config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False
        )
        self.v_proj = nn.Linear(
            config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False
        )
        self.o_proj = nn.Linear(
            config.num_attention_heads * self.head_dim, config.hidden_size, bias=False
        )
        self.q_norm = Olmo2RMSNorm(config.num_attention_heads * self.head_dim, config.rms_norm_eps)
        self.k_norm = Olmo2RMSNorm(config.num_key_value_heads * self.head_dim, config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask=None):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        query_states = self.q_norm(self.q_proj(hidden_states))
        key_states = self.k_norm(self.k_proj(hidden_states))
        value_states = self.v_proj(hidden_states)

        query_states = query_states.view(hidden_shape).transpose(1, 2)
        key_states = key_states.view(hidden_shape).transpose(1, 2)
        value_states = value_states.view(hidden_shape).transpose(1, 2)

        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)

        attn_output = split_kv_attention(
            query_states,
            key_states,
            value_states,
            self.scaling,
            attention_mask,
            self.config.num_kv_splits,
        )
        attn_output = attn_output.transpose(1, 2).reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output)


class Olmo2MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Olmo2DecoderLayer(nn.Module):
    """OLMo 2 reorders the norms: attention and MLP outputs are normed before the residual add."""

    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = Olmo2Attention(config, layer_idx)
        self.mlp = Olmo2MLP(config)
        self.post_attention_layernorm = Olmo2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_feedforward_layernorm = Olmo2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask=None):
        residual = hidden_states
        hidden_states = self.self_attn(
            hidden_states, position_embeddings, attention_mask=attention_mask
        )
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_feedforward_layernorm(self.mlp(hidden_states))
        return residual + hidden_states


def causal_mask(seq_len, dtype, device):
    mask = torch.full((seq_len, seq_len), torch.finfo(dtype).min, dtype=dtype, device=device)
    return torch.triu(mask, diagonal=1)[None, None]


class Olmo2Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList([Olmo2DecoderLayer(config, 0)])
        self.norm = Olmo2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Olmo2RotaryEmbedding(config)

    def forward(self, inputs_embeds):
        seq_len = inputs_embeds.shape[1]
        position_ids = torch.arange(seq_len, device=inputs_embeds.device).unsqueeze(0)
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        attention_mask = causal_mask(seq_len, inputs_embeds.dtype, inputs_embeds.device)
        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_embeddings)
        return self.norm(hidden_states)


def make_olmo2_split_kv():
    torch.manual_seed(1521)
    model = Olmo2Model(Olmo2Config())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, Olmo2RMSNorm):
                mod.weight.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {
    "target": "make_olmo2_split_kv",
    "kind": "causal-multihead",
    "ok": False,
    "layer": "layers.0.self_attn",
    "stage": "masked_scores",
    "mistake": "missing_mask",
    "style": "OLMo 2 split-KV log-sum-exp merge: Olmo2Model calls layer(hidden_states, position_embeddings) "
    "without attention_mask=, so the split-KV core runs unmasked",
}

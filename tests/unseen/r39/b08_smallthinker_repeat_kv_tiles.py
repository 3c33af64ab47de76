"""SmallThinker (PowerInfer / SJTU-IPADS, `modeling_smallthinker.py`): on-device MoE decoder with GQA
and a per-layer layout of RoPE vs NoPE (`rope_layout`) and sliding-window vs full attention
(`sliding_window_layout`); the model builds one additive mask per attention type and hands the
layer the one its type needs. ReGLU experts (here a single dense ReGLU FFN stands in for the router).

This file: one bug: repeat_kv expands a new axis before the kv heads ([:, None]), tiling: query head
h meets kv head h % 2."""

import torch
import torch.nn.functional as F
from torch import nn


class SmallThinkerConfig:
    hidden_size = 64
    num_attention_heads = 8
    num_key_value_heads = 2
    head_dim = 8
    rope_theta = 1000000.0
    rope_layout = [0]  # 1 = RoPE layer, 0 = NoPE layer
    sliding_window_layout = [0]  # 1 = sliding-window layer
    sliding_window_size = 4096
    max_position_embeddings = 256
    rms_norm_eps = 1e-6
    moe_ffn_hidden_size = 96
    attn_implementation = "sdpa"
    num_hidden_layers = 1


class SmallThinkerRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states


class SmallThinkerRotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dim = config.head_dim
        self.base = config.rope_theta

    @torch.no_grad()
    def forward(self, x, position_ids):
        # the table is built in float64 on every call, then cast to the activations' dtype
        exponents = torch.arange(0, self.dim, 2, dtype=torch.float64, device=x.device) / self.dim
        inv_freq = 1.0 / (self.base**exponents)
        freqs = position_ids[:, :, None].to(torch.float64) * inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x, cos, sin):
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    return (x * cos) + (rotate_half(x) * sin)


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, None, :, :, :].expand(
        batch, n_rep, num_key_value_heads, slen, head_dim
    )
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class SmallThinkerAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.use_rope = bool(config.rope_layout[layer_idx])
        self.is_sliding = bool(config.sliding_window_layout[layer_idx])
        self.sliding_window = config.sliding_window_size if self.is_sliding else None
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(
            config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False
        )
        self.v_proj = nn.Linear(
            config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False
        )
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(
        self, hidden_states, position_ids, rotary_emb, attention_mask=None, past_key_value=None
    ):
        bsz, q_len, _ = hidden_states.shape
        query_states = (
            self.q_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        )
        key_states = self.k_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        value_states = (
            self.v_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        )

        if self.use_rope:
            cos, sin = rotary_emb(value_states, position_ids)
            query_states = apply_rotary(query_states, cos, sin)
            # keys carry their own positions so that a cache can be prepended later
            kv_offset = 0 if past_key_value is None else past_key_value[0].shape[-2]
            key_positions = torch.arange(
                kv_offset, kv_offset + key_states.shape[-2], device=hidden_states.device
            )[None].expand(bsz, -1)
            cos_k, sin_k = rotary_emb(value_states, key_positions)
            key_states = apply_rotary(key_states, cos_k, sin_k)

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
            attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.scaling
            if attention_mask is not None:
                attn_weights = attn_weights + attention_mask
            attn_weights = nn.functional.softmax(attn_weights, dim=-1)
            attn_output = torch.matmul(attn_weights, value_states)

        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, -1)
        attn_output = self.o_proj(attn_output)
        return attn_output


class SmallThinkerReGLU(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.up = nn.Linear(config.hidden_size, config.moe_ffn_hidden_size, bias=False)
        self.gate = nn.Linear(config.hidden_size, config.moe_ffn_hidden_size, bias=False)
        self.down = nn.Linear(config.moe_ffn_hidden_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down(F.relu(self.gate(x)) * self.up(x))


class SmallThinkerDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = SmallThinkerAttention(config, layer_idx)
        self.block_sparse_moe = SmallThinkerReGLU(config)
        self.input_layernorm = SmallThinkerRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = SmallThinkerRMSNorm(
            config.hidden_size, eps=config.rms_norm_eps
        )

    def forward(self, hidden_states, position_ids, rotary_emb, attention_mask):
        residual = hidden_states
        hidden_states = self.self_attn(
            self.input_layernorm(hidden_states), position_ids, rotary_emb, attention_mask
        )
        hidden_states = residual + hidden_states
        residual = hidden_states
        return residual + self.block_sparse_moe(self.post_attention_layernorm(hidden_states))


def build_attention_masks(config, seq_len, dtype, device):
    """One additive mask per attention type; None where SDPA's own causal flag suffices."""
    rows = torch.arange(seq_len, device=device)[:, None]
    cols = torch.arange(seq_len, device=device)[None, :]
    causal = cols <= rows
    masks = {}
    if any(config.sliding_window_layout):
        allowed = causal & (rows - cols < config.sliding_window_size)
        masks["sliding"] = torch.zeros(seq_len, seq_len, dtype=dtype, device=device).masked_fill(
            ~allowed, torch.finfo(dtype).min
        )[None, None]
    if config.attn_implementation == "sdpa":
        masks["full"] = None
    else:
        masks["full"] = torch.zeros(seq_len, seq_len, dtype=dtype, device=device).masked_fill(
            ~causal, torch.finfo(dtype).min
        )[None, None]
    return masks


class SmallThinkerModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(
            [SmallThinkerDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = SmallThinkerRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = SmallThinkerRotaryEmbedding(config)

    def forward(self, inputs_embeds):
        bsz, seq_len, _ = inputs_embeds.shape
        position_ids = torch.arange(seq_len, device=inputs_embeds.device)[None].expand(bsz, -1)
        masks = build_attention_masks(
            self.config, seq_len, inputs_embeds.dtype, inputs_embeds.device
        )
        hidden_states = inputs_embeds
        for layer in self.layers:
            mask = masks["sliding"] if layer.self_attn.is_sliding else masks["full"]
            hidden_states = layer(hidden_states, position_ids, self.rotary_emb, mask)
        return self.norm(hidden_states)


def make_smallthinker_model():
    torch.manual_seed(3905)
    model = SmallThinkerModel(SmallThinkerConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, SmallThinkerRMSNorm):
                mod.weight.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {
    "target": "make_smallthinker_model",
    "kind": "causal-multihead",
    "ok": False,
    "layer": "layers.0.self_attn",
    "stage": "scores",
    "mistake": "kv_group_mapping",
    "style": "SmallThinker attention (PowerInfer, GQA, RoPE/NoPE and sliding-window layouts) (base "
    "c05): one bug: repeat_kv expands a new axis before the kv heads ([:, None]), tiling: "
    "query head h meets kv head h % 2",
}

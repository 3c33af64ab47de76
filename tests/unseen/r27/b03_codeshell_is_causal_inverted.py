"""CodeShell (WisdomShell, remote code modeling_codeshell.py, GPT-BigCode lineage): one fused c_attn
projection that emits the queries plus num_query_groups key and value heads, split with
.split((embed_dim, kv_dim, kv_dim)), rotate_half RoPE from cos_cached/sin_cached tables indexed by
position_ids (optionally linear-scaled positions), repeat_kv for the grouped heads, torch SDPA with
is_causal when no mask is given, c_proj; pre-LayerNorm GPT-2 style block (ln_1, ln_2, GELU c_fc/c_proj).

This file: one bug: is_causal condition inverted (attention_mask is not None); the model passes no mask, so SDPA runs unmasked"""

import math

import torch
from torch import nn
from torch.nn import functional as F


class CodeShellConfig:
    n_embd = 64
    n_head = 8
    num_query_groups = 2
    group_query_attention = True
    position_embedding_type = "rope"
    rope_scaling = None
    n_positions = 128
    layer_norm_epsilon = 1e-5
    n_inner = 256
    use_logn_attn = False
    seq_length = 8


class CodeShellRotaryEmbedding(nn.Module):
    def __init__(self, dim, max_position_embeddings=2048, base=10000):
        super().__init__()
        self.dim = dim
        self.max_position_embeddings = max_position_embeddings
        self.base = base
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2, dtype=torch.float64) / self.dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._set_cos_sin_cache(max_position_embeddings)

    def _positions(self, seq_len):
        return torch.arange(seq_len, dtype=torch.float64)

    def _set_cos_sin_cache(self, seq_len):
        self.max_seq_len_cached = seq_len
        t = self._positions(seq_len)
        freqs = torch.einsum("i,j->ij", t, self.inv_freq.to(torch.float64))
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def forward(self, x, seq_len=None):
        if seq_len > self.max_seq_len_cached:
            self._set_cos_sin_cache(seq_len)
        return (
            self.cos_cached[:seq_len].to(dtype=x.dtype),
            self.sin_cached[:seq_len].to(dtype=x.dtype),
        )


class CodeShellLinearScalingRotaryEmbedding(CodeShellRotaryEmbedding):
    """Position interpolation: positions divided by the scaling factor before the outer product."""

    def __init__(self, dim, max_position_embeddings=2048, base=10000, scaling_factor=1.0):
        self.scaling_factor = scaling_factor
        super().__init__(dim, max_position_embeddings, base)

    def _positions(self, seq_len):
        return torch.arange(seq_len, dtype=torch.float64) / self.scaling_factor


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids):
    cos = cos[position_ids].unsqueeze(1)  # [bs, 1, seq_len, dim]
    sin = sin[position_ids].unsqueeze(1)
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


class CodeShellAttention(nn.Module):
    def __init__(self, config, layer_idx=None):
        super().__init__()
        self.config = config
        self.embed_dim = config.n_embd
        self.num_heads = config.n_head
        self.head_dim = self.embed_dim // self.num_heads
        self.group_query_attention = config.group_query_attention
        self.num_query_groups = config.num_query_groups
        self.kv_heads = config.num_query_groups if self.group_query_attention else self.num_heads
        self.kv_dim = self.kv_heads * self.head_dim
        self.layer_idx = layer_idx
        self.c_attn = nn.Linear(self.embed_dim, self.embed_dim + 2 * self.kv_dim)
        self.c_proj = nn.Linear(self.embed_dim, self.embed_dim)
        self.position_embedding_type = config.position_embedding_type
        self.rope_scaling = config.rope_scaling
        self._init_rope()
        if config.use_logn_attn:
            logn_list = [
                math.log(i, config.seq_length) if i > config.seq_length else 1.0
                for i in range(1, config.n_positions + 1)
            ]
            self.register_buffer(
                "logn_tensor", torch.tensor(logn_list, dtype=torch.float64), persistent=False
            )

    def _init_rope(self):
        if self.rope_scaling is None:
            self.rotary_emb = CodeShellRotaryEmbedding(
                self.head_dim, max_position_embeddings=self.config.n_positions
            )
        else:
            scaling_type = self.rope_scaling["type"]
            scaling_factor = self.rope_scaling["factor"]
            if scaling_type == "linear":
                self.rotary_emb = CodeShellLinearScalingRotaryEmbedding(
                    self.head_dim,
                    max_position_embeddings=self.config.n_positions,
                    scaling_factor=scaling_factor,
                )
            else:
                raise ValueError(f"Unknown RoPE scaling type {scaling_type}")

    def forward(self, hidden_states, position_ids=None, attention_mask=None):
        bsz, q_len, _ = hidden_states.size()
        query_states, key_states, value_states = self.c_attn(hidden_states).split(
            (self.embed_dim, self.kv_dim, self.kv_dim), dim=2
        )

        query_states = query_states.view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = key_states.view(bsz, q_len, self.kv_heads, self.head_dim).transpose(1, 2)
        value_states = value_states.view(bsz, q_len, self.kv_heads, self.head_dim).transpose(1, 2)

        kv_seq_len = key_states.shape[-2]
        cos, sin = self.rotary_emb(value_states, seq_len=kv_seq_len)
        query_states, key_states = apply_rotary_pos_emb(
            query_states, key_states, cos, sin, position_ids
        )
        if self.config.use_logn_attn:
            logn = self.logn_tensor[kv_seq_len - q_len : kv_seq_len].to(query_states.dtype)
            query_states = query_states * logn[None, None, :, None]

        key_states = repeat_kv(key_states, self.num_heads // self.kv_heads)
        value_states = repeat_kv(value_states, self.num_heads // self.kv_heads)

        attn_output = F.scaled_dot_product_attention(
            query_states,
            key_states,
            value_states,
            attn_mask=attention_mask,
            is_causal=attention_mask is not None and q_len > 1,
        )
        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, self.embed_dim)
        return self.c_proj(attn_output)


class CodeShellMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, config.n_inner)
        self.c_proj = nn.Linear(config.n_inner, config.n_embd)

    def forward(self, hidden_states):
        return self.c_proj(F.gelu(self.c_fc(hidden_states), approximate="tanh"))


class CodeShellBlock(nn.Module):
    def __init__(self, config, layer_idx=None):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = CodeShellAttention(config, layer_idx=layer_idx)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = CodeShellMLP(config)

    def forward(self, hidden_states, position_ids=None, attention_mask=None):
        residual = hidden_states
        attn_output = self.attn(
            self.ln_1(hidden_states), position_ids=position_ids, attention_mask=attention_mask
        )
        hidden_states = attn_output + residual
        return hidden_states + self.mlp(self.ln_2(hidden_states))


class CodeShellModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.h = nn.ModuleList([CodeShellBlock(config, layer_idx=0)])
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)

    def forward(self, inputs_embeds):
        bsz, seq_length = inputs_embeds.shape[:2]
        past_length = 0
        position_ids = torch.arange(
            past_length, seq_length + past_length, dtype=torch.long, device=inputs_embeds.device
        )
        position_ids = position_ids.unsqueeze(0).expand(bsz, seq_length)
        hidden_states = inputs_embeds
        for block in self.h:
            hidden_states = block(hidden_states, position_ids=position_ids)
        return self.ln_f(hidden_states)


def make_codeshell():
    torch.manual_seed(2705)
    config = CodeShellConfig()
    model = CodeShellModel(config)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {
    "target": "make_codeshell",
    "kind": "causal-multihead",
    "ok": False,
    "layer": "h.0.attn",
    "stage": "masked_scores",
    "mistake": "missing_mask",
    "style": "CodeShell CodeShellAttention: SDPA is_causal=attention_mask is not None: no causal mask at all",
}

"""IBM Bamba hybrid model body: a Mamba-style mixer layer, then an attention layer.

BambaAttention is Llama-shaped with a partial rotary (attn_rotary_emb = 8 of head_dim 16):
the rotary tables have width 8 and apply_rotary_pos_emb rotates q[..., :8] with
rotate_half, passing q[..., 8:] through. GQA 4:2 via repeat_kv, eager path, additive
finfo.min causal mask and cos/sin built by the model. The mixer stub is a gated causal
depthwise convolution standing in for the Mamba2 mixer.
"""

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class BambaConfig:
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    attn_rotary_emb: int = 8
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    attn_layer_indices: list = field(default_factory=lambda: [1])
    num_hidden_layers: int = 2


class BambaRMSNormGated(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class BambaRotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        dim = config.attn_rotary_emb
        inv_freq = 1.0 / (
            config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
        )
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x, position_ids):
        inv_freq_expanded = (
            self.inv_freq[None, :, None].to(x.dtype).expand(position_ids.shape[0], -1, 1)
        )
        position_ids_expanded = position_ids[:, None, :].to(x.dtype)
        freqs = (inv_freq_expanded @ position_ids_expanded).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    rotary_dim = cos.shape[-1]
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_embed = (q_rot * cos) + (rotate_half(q_rot) * sin)
    k_embed = (k_rot * cos) + (rotate_half(k_rot) * sin)
    q_embed = torch.cat([q_embed, q_pass], dim=-1)
    k_embed = torch.cat([k_embed, k_pass], dim=-1)
    return q_embed, k_embed


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(
        batch, num_key_value_heads, n_rep, slen, head_dim
    )
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class BambaAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.is_causal = True
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

    def forward(self, hidden_states, position_embeddings, attention_mask):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.scaling
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask[:, :, :, : key_states.shape[-2]]
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(
            query_states.dtype
        )
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).contiguous().reshape(*input_shape, -1)
        return self.o_proj(attn_output), attn_weights


class MixerStub(nn.Module):
    """Stands in for BambaMixer: gated causal depthwise conv over time."""

    def __init__(self, hidden_size):
        super().__init__()
        self.in_proj = nn.Linear(hidden_size, 2 * hidden_size, bias=False)
        self.conv1d = nn.Conv1d(
            hidden_size, hidden_size, kernel_size=4, groups=hidden_size, padding=3
        )
        self.out_proj = nn.Linear(hidden_size, hidden_size, bias=False)

    def forward(self, x):
        h, gate = self.in_proj(x).chunk(2, dim=-1)
        h = self.conv1d(h.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)
        return self.out_proj(nn.functional.silu(h) * nn.functional.silu(gate))


class BambaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx, layer_type="mamba"):
        super().__init__()
        self.layer_type = layer_type
        if layer_type == "mamba":
            self.mamba = MixerStub(config.hidden_size)
        else:
            self.self_attn = BambaAttention(config, layer_idx)
        self.input_layernorm = BambaRMSNormGated(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        if self.layer_type == "mamba":
            hidden_states = self.mamba(hidden_states)
        else:
            hidden_states, _ = self.self_attn(hidden_states, position_embeddings, attention_mask)
        return residual + hidden_states


class BambaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList(
            [
                BambaDecoderLayer(
                    config, i, "attention" if i in config.attn_layer_indices else "mamba"
                )
                for i in range(config.num_hidden_layers)
            ]
        )
        self.rotary_emb = BambaRotaryEmbedding(config)
        self.final_layernorm = BambaRMSNormGated(config.hidden_size, config.rms_norm_eps)

    def forward(self, inputs_embeds):
        bsz, n, _ = inputs_embeds.shape
        cache_position = torch.arange(n)
        position_ids = cache_position.unsqueeze(0).expand(bsz, -1)
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        min_dtype = torch.finfo(inputs_embeds.dtype).min
        causal_mask = torch.full((n, n), fill_value=min_dtype, dtype=inputs_embeds.dtype)
        causal_mask = torch.triu(causal_mask, diagonal=1)[None, None].expand(bsz, 1, -1, -1)
        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(
                hidden_states, attention_mask=causal_mask, position_embeddings=position_embeddings
            )
        return self.final_layernorm(hidden_states)


def make_bamba():
    torch.manual_seed(111)
    model = BambaModel(BambaConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, BambaRMSNormGated):
                mod.weight.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {
    "target": "make_bamba",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "layers.1.self_attn",
    "structure": {
        "heads": 4,
        "kv_heads": 2,
        "head_dim": 16,
        "causal": True,
        "cross": False,
        "rope": {"pairing": "half", "fraction": 0.5, "base": 10000},
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "HF Bamba hybrid body (mixer layer 0, attention layer 1 from attn_layer_indices): partial rotary "
    "attn_rotary_emb 8 of 16 with rotate_half on the slice, GQA 4:2 repeat_kv, eager, finfo.min triu mask",
}

"""Zyphra Zamba2 (HF Zamba2) hybrid body: a mixer layer, then a hybrid layer that calls the
shared attention block.

The shared block attends over concatenate([hidden_states, original_hidden_states]) (twice
the model width, 64 = 2 x 32) after an RMSNorm of that width; q/k/v are the shared
projections plus a per-invocation LoRA adapter (linear_q/k/v_adapter_list, rank 8, picked
by layer_block_map.index(layer_idx)); rotary by halves (use_mem_rope); o_proj maps back to
the model width. MHA, 4 heads of 16. Zamba2 itself scales by (head_dim / 2) ** -0.5 because
of the doubled width; this file uses head_dim ** -0.5 so that no scale question arises.
"""

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class Zamba2Config:
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    adapter_rank: int = 8
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    use_mem_rope: bool = True
    use_shared_attention_adapter: bool = True
    hybrid_layer_ids: list = field(default_factory=lambda: [1])
    num_hidden_layers: int = 2

    @property
    def attention_hidden_size(self):
        return 2 * self.hidden_size

    @property
    def attention_head_dim(self):
        return 2 * self.hidden_size // self.num_attention_heads


class Zamba2RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class Zamba2RotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        dim = config.attention_head_dim
        inv_freq = 1.0 / (
            config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
        )
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x, position_ids):
        freqs = torch.einsum("bt,f->btf", position_ids.to(x.dtype), self.inv_freq.to(x.dtype))
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class Zamba2Attention(nn.Module):
    def __init__(self, config, num_fwd_mem_blocks, block_id=0):
        super().__init__()
        self.config = config
        self.attention_hidden_size = config.attention_hidden_size
        self.head_dim = config.attention_head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(
            config.attention_hidden_size, config.num_attention_heads * self.head_dim, bias=False
        )
        self.k_proj = nn.Linear(
            config.attention_hidden_size, config.num_key_value_heads * self.head_dim, bias=False
        )
        self.v_proj = nn.Linear(
            config.attention_hidden_size, config.num_key_value_heads * self.head_dim, bias=False
        )
        self.o_proj = nn.Linear(
            config.num_attention_heads * self.head_dim, config.hidden_size, bias=False
        )
        self.layer_block_map = config.hybrid_layer_ids
        self.linear_q_adapter_list = nn.ModuleList([])
        self.linear_k_adapter_list = nn.ModuleList([])
        self.linear_v_adapter_list = nn.ModuleList([])
        for _ in range(num_fwd_mem_blocks):
            for lst, out in (
                (self.linear_q_adapter_list, config.num_attention_heads * self.head_dim),
                (self.linear_k_adapter_list, config.num_key_value_heads * self.head_dim),
                (self.linear_v_adapter_list, config.num_key_value_heads * self.head_dim),
            ):
                lst.append(
                    nn.Sequential(
                        nn.Linear(self.attention_hidden_size, config.adapter_rank, bias=False),
                        nn.Linear(config.adapter_rank, out, bias=False),
                    )
                )

    def forward(self, hidden_states, layer_idx, attention_mask=None, position_embeddings=None):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states)
        key_states = self.k_proj(hidden_states)
        value_states = self.v_proj(hidden_states)
        if self.config.use_shared_attention_adapter:
            adapter_layer_idx = self.layer_block_map.index(layer_idx)
            query_states = query_states + self.linear_q_adapter_list[adapter_layer_idx](
                hidden_states
            )
            key_states = key_states + self.linear_k_adapter_list[adapter_layer_idx](hidden_states)
            value_states = value_states + self.linear_v_adapter_list[adapter_layer_idx](
                hidden_states
            )

        query_states = query_states.view(hidden_shape).transpose(1, 2)
        key_states = key_states.view(hidden_shape).transpose(1, 2)
        value_states = value_states.view(hidden_shape).transpose(1, 2)

        if self.config.use_mem_rope:
            cos, sin = position_embeddings
            query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.scaling
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask[:, :, :, : key_states.shape[-2]]
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(
            query_states.dtype
        )
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).contiguous().reshape(*input_shape, -1)
        return self.o_proj(attn_output), attn_weights


class Zamba2AttentionDecoderLayer(nn.Module):
    def __init__(self, config, num_fwd_mem_blocks):
        super().__init__()
        self.self_attn = Zamba2Attention(config, num_fwd_mem_blocks)
        self.input_layernorm = Zamba2RMSNorm(config.attention_hidden_size, eps=config.rms_norm_eps)
        self.pre_ff_layernorm = Zamba2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.feed_forward = nn.Sequential(
            nn.Linear(config.hidden_size, 2 * config.hidden_size, bias=False),
            nn.GELU(),
            nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False),
        )

    def forward(
        self, hidden_states, original_hidden_states, layer_idx, attention_mask, position_embeddings
    ):
        hidden_states = torch.concatenate([hidden_states, original_hidden_states], dim=-1)
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states,
            layer_idx=layer_idx,
            attention_mask=attention_mask,
            position_embeddings=position_embeddings,
        )
        hidden_states = self.pre_ff_layernorm(hidden_states)
        return self.feed_forward(hidden_states)


class MixerStub(nn.Module):
    """Stands in for the Mamba2 mixer: gated causal depthwise conv."""

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


class Zamba2MambaDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.mamba = MixerStub(config.hidden_size)
        self.input_layernorm = Zamba2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, transformer_hidden_states=None):
        if transformer_hidden_states is not None:
            hidden_states = hidden_states + transformer_hidden_states
        return hidden_states + self.mamba(self.input_layernorm(hidden_states))


class Zamba2HybridLayer(nn.Module):
    def __init__(self, shared_transformer, linear, mamba):
        super().__init__()
        self.linear = linear
        self.mamba_decoder = mamba
        self.shared_transformer = shared_transformer

    def forward(
        self, hidden_states, original_hidden_states, layer_idx, causal_mask, position_embeddings
    ):
        transformer_hidden_states = self.shared_transformer(
            hidden_states, original_hidden_states, layer_idx, causal_mask, position_embeddings
        )
        transformer_hidden_states = self.linear(transformer_hidden_states)
        return self.mamba_decoder(
            hidden_states, transformer_hidden_states=transformer_hidden_states
        )


class Zamba2Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        shared = Zamba2AttentionDecoderLayer(
            config, num_fwd_mem_blocks=len(config.hybrid_layer_ids)
        )
        layers = []
        for i in range(config.num_hidden_layers):
            if i in config.hybrid_layer_ids:
                layers.append(
                    Zamba2HybridLayer(
                        shared,
                        nn.Linear(config.hidden_size, config.hidden_size, bias=False),
                        Zamba2MambaDecoderLayer(config),
                    )
                )
            else:
                layers.append(Zamba2MambaDecoderLayer(config))
        self.layers = nn.ModuleList(layers)
        self.rotary_emb = Zamba2RotaryEmbedding(config)
        self.final_layernorm = Zamba2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, inputs_embeds):
        bsz, n, _ = inputs_embeds.shape
        original_hidden_states = torch.clone(inputs_embeds)
        position_ids = torch.arange(n).unsqueeze(0).expand(bsz, -1)
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        causal_mask = torch.full(
            (n, n), torch.finfo(inputs_embeds.dtype).min, dtype=inputs_embeds.dtype
        ).triu(1)
        causal_mask = causal_mask[None, None].expand(bsz, 1, n, n)
        hidden_states = inputs_embeds
        for layer_idx, layer in enumerate(self.layers):
            if isinstance(layer, Zamba2HybridLayer):
                hidden_states = layer(
                    hidden_states,
                    original_hidden_states,
                    layer_idx,
                    causal_mask,
                    position_embeddings,
                )
            else:
                hidden_states = layer(hidden_states)
        return self.final_layernorm(hidden_states)


def make_zamba2():
    torch.manual_seed(118)
    model = Zamba2Model(Zamba2Config())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, Zamba2RMSNorm):
                mod.weight.uniform_(0.5, 1.5)
        attn = model.layers[1].shared_transformer.self_attn
        for lst in (
            attn.linear_q_adapter_list,
            attn.linear_k_adapter_list,
            attn.linear_v_adapter_list,
        ):
            lst[0][1].weight.normal_(
                0.0, 0.2
            )  # LoRA B is zero at init; give it a trained-looking value
    return model.eval()


EXPECT = {
    "target": "make_zamba2",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "layers.1.shared_transformer.self_attn",
    "structure": {
        "heads": 4,
        "kv_heads": 4,
        "head_dim": 16,
        "causal": True,
        "cross": False,
        "rope": {"pairing": "half", "fraction": 1.0, "base": 10000},
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "HF Zamba2 hybrid body: shared attention block over concatenate([hidden, original_hidden]) (64 = 2 x 32) "
    "after a 64-wide RMSNorm, q/k/v = shared projection + per-invocation LoRA adapter (rank 8), rotate_half rope "
    "(use_mem_rope), o_proj back to 32; scale set to head_dim**-0.5 (Zamba2 uses (head_dim/2)**-0.5)",
}

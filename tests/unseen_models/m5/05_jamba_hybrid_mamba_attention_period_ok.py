"""A Jamba-style hybrid in the shape of transformers' modeling_jamba.py (written from memory, in my
own words, much reduced): `model.layers.N` alternates JambaMambaDecoderLayer (a small selective
state-space mixer: in_proj to x|z, depthwise causal conv1d of width 4, x_proj to dt|B|C, softplus
dt_proj, A = -exp(A_log), sequential scan, D skip, silu(z) gate, out_proj) and
JambaAttentionDecoderLayer with attn_layer_period = 2, attn_layer_offset = 1, so only layers 1 and
3 of 4 have attention.  Attention has no positional encoding at all (Jamba relies on the Mamba
layers for order): q/k/v/o without bias, GQA 4 heads / 2 kv heads of 16, repeat_kv, SDPA with
is_causal for multi-token calls.  RMSNorm input_layernorm / pre_ff_layernorm, SwiGLU feed_forward.

Cache (hf): out = model(prompt, use_cache=True); out = model(tok, past_key_values=out.past_key_values,
use_cache=True).  With use_cache=True and no cache given, the model creates a
HybridMambaAttentionDynamicCache (defined below) that holds conv/ssm states for Mamba layers and a
growing (batch, kv_heads, seq, head_dim) key/value cache for attention layers.

Correct.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": ["model.layers.1.self_attn", "model.layers.3.self_attn"],
    "kind": "causal-multihead",
    "cache": "hf",
    "structure": {
        "heads": 4,
        "kv_heads": 2,
        "head_dim": 16,
        "causal": True,
        "cross": False,
        "rope": None,
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "modeling_jamba.py hybrid: attention only on layers 1 and 3 of 4 (period 2, offset 1), NoPE GQA "
    "4/2 attention, Mamba-like mixers elsewhere, HybridMambaAttentionDynamicCache",
}


class JambaConfig:
    vocab_size = 150
    hidden_size = 64
    intermediate_size = 96
    num_hidden_layers = 4
    num_attention_heads = 4
    num_key_value_heads = 2
    attn_layer_period = 2
    attn_layer_offset = 1
    mamba_d_state = 4
    mamba_d_conv = 4
    mamba_expand = 1
    mamba_dt_rank = 8
    rms_norm_eps = 1e-6

    @property
    def layers_block_type(self):
        return [
            "attention" if i % self.attn_layer_period == self.attn_layer_offset else "mamba"
            for i in range(self.num_hidden_layers)
        ]


class HybridMambaAttentionDynamicCache:
    def __init__(self, config, batch_size, dtype):
        self.layers_block_type = config.layers_block_type
        inner = config.mamba_expand * config.hidden_size
        self.conv_states = {}
        self.ssm_states = {}
        self.key_cache = {}
        self.value_cache = {}
        self.has_previous_state = False
        for i, kind in enumerate(self.layers_block_type):
            if kind == "mamba":
                self.conv_states[i] = torch.zeros(
                    batch_size, inner, config.mamba_d_conv, dtype=dtype
                )
                self.ssm_states[i] = torch.zeros(
                    batch_size, inner, config.mamba_d_state, dtype=dtype
                )

    def update(self, key_states, value_states, layer_idx):
        if layer_idx in self.key_cache:
            self.key_cache[layer_idx] = torch.cat([self.key_cache[layer_idx], key_states], dim=-2)
            self.value_cache[layer_idx] = torch.cat(
                [self.value_cache[layer_idx], value_states], dim=-2
            )
        else:
            self.key_cache[layer_idx] = key_states
            self.value_cache[layer_idx] = value_states
        return self.key_cache[layer_idx], self.value_cache[layer_idx]

    def get_seq_length(self):
        for i, kind in enumerate(self.layers_block_type):
            if kind == "attention" and i in self.key_cache:
                return self.key_cache[i].shape[-2]
        return 0


class JambaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(
        batch, num_key_value_heads, n_rep, slen, head_dim
    )
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class JambaAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(
            self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False
        )
        self.v_proj = nn.Linear(
            self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False
        )
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=False)

    def forward(self, hidden_states, past_key_value=None):
        bsz, q_len, _ = hidden_states.size()
        query_states = (
            self.q_proj(hidden_states)
            .view(bsz, q_len, self.num_heads, self.head_dim)
            .transpose(1, 2)
        )
        key_states = (
            self.k_proj(hidden_states)
            .view(bsz, q_len, self.num_key_value_heads, self.head_dim)
            .transpose(1, 2)
        )
        value_states = (
            self.v_proj(hidden_states)
            .view(bsz, q_len, self.num_key_value_heads, self.head_dim)
            .transpose(1, 2)
        )
        if past_key_value is not None:
            key_states, value_states = past_key_value.update(
                key_states, value_states, self.layer_idx
            )
        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)
        attn_output = F.scaled_dot_product_attention(
            query_states, key_states, value_states, is_causal=q_len > 1
        )
        attn_output = attn_output.transpose(1, 2).contiguous().view(bsz, q_len, self.hidden_size)
        return self.o_proj(attn_output), None, past_key_value


class JambaMambaMixer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.intermediate_size = config.mamba_expand * config.hidden_size
        self.ssm_state_size = config.mamba_d_state
        self.conv_kernel_size = config.mamba_d_conv
        self.time_step_rank = config.mamba_dt_rank
        self.in_proj = nn.Linear(config.hidden_size, self.intermediate_size * 2, bias=False)
        self.conv1d = nn.Conv1d(
            self.intermediate_size,
            self.intermediate_size,
            self.conv_kernel_size,
            groups=self.intermediate_size,
            padding=self.conv_kernel_size - 1,
        )
        self.x_proj = nn.Linear(
            self.intermediate_size, self.time_step_rank + self.ssm_state_size * 2, bias=False
        )
        self.dt_proj = nn.Linear(self.time_step_rank, self.intermediate_size, bias=True)
        A = torch.arange(1, self.ssm_state_size + 1, dtype=torch.float32)[None, :].expand(
            self.intermediate_size, -1
        )
        self.A_log = nn.Parameter(torch.log(A).contiguous())
        self.D = nn.Parameter(torch.ones(self.intermediate_size))
        self.out_proj = nn.Linear(self.intermediate_size, config.hidden_size, bias=False)

    def forward(self, hidden_states, cache_params=None):
        batch_size, seq_len, _ = hidden_states.shape
        projected = self.in_proj(hidden_states).transpose(1, 2)
        x, gate = projected.chunk(2, dim=1)
        use_state = cache_params is not None and cache_params.has_previous_state
        if use_state:
            conv_state = torch.cat([cache_params.conv_states[self.layer_idx], x], dim=-1)
            full = F.conv1d(
                conv_state, self.conv1d.weight, self.conv1d.bias, groups=self.intermediate_size
            )
            x_conv = full[..., -seq_len:]
            cache_params.conv_states[self.layer_idx] = conv_state[..., -self.conv_kernel_size :]
        else:
            x_conv = self.conv1d(x)[..., :seq_len]
            if cache_params is not None:
                padded = (
                    F.pad(x, (self.conv_kernel_size - x.shape[-1], 0))
                    if x.shape[-1] < self.conv_kernel_size
                    else x
                )
                cache_params.conv_states[self.layer_idx] = padded[..., -self.conv_kernel_size :]
        x_conv = F.silu(x_conv)
        ssm_parameters = self.x_proj(x_conv.transpose(1, 2))
        time_step, B, C = torch.split(
            ssm_parameters, [self.time_step_rank, self.ssm_state_size, self.ssm_state_size], dim=-1
        )
        dt = F.softplus(self.dt_proj(time_step)).transpose(1, 2)  # (b, inner, T)
        A = -torch.exp(self.A_log.to(hidden_states.dtype))
        if use_state:
            ssm_state = cache_params.ssm_states[self.layer_idx]
        else:
            ssm_state = torch.zeros(
                batch_size, self.intermediate_size, self.ssm_state_size, dtype=hidden_states.dtype
            )
        ys = []
        for t in range(seq_len):
            dA = torch.exp(A[None] * dt[:, :, t, None])
            dBx = dt[:, :, t, None] * B[:, None, t, :] * x_conv[:, :, t, None]
            ssm_state = dA * ssm_state + dBx
            ys.append((ssm_state * C[:, None, t, :]).sum(-1))
        y = torch.stack(ys, dim=-1) + x_conv * self.D[None, :, None]
        if cache_params is not None:
            cache_params.ssm_states[self.layer_idx] = ssm_state
        y = y * F.silu(gate)
        return self.out_proj(y.transpose(1, 2))


class JambaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class JambaAttentionDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = JambaAttention(config, layer_idx)
        self.feed_forward = JambaMLP(config)
        self.input_layernorm = JambaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.pre_ff_layernorm = JambaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, past_key_value=None):
        residual = hidden_states
        hidden_states, _, _ = self.self_attn(self.input_layernorm(hidden_states), past_key_value)
        hidden_states = residual + hidden_states
        return hidden_states + self.feed_forward(self.pre_ff_layernorm(hidden_states))


class JambaMambaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.mamba = JambaMambaMixer(config, layer_idx)
        self.feed_forward = JambaMLP(config)
        self.input_layernorm = JambaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.pre_ff_layernorm = JambaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, past_key_value=None):
        residual = hidden_states
        hidden_states = residual + self.mamba(self.input_layernorm(hidden_states), past_key_value)
        return hidden_states + self.feed_forward(self.pre_ff_layernorm(hidden_states))


ALL_DECODER_LAYER_TYPES = {"attention": JambaAttentionDecoderLayer, "mamba": JambaMambaDecoderLayer}


class JambaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            ALL_DECODER_LAYER_TYPES[kind](config, i)
            for i, kind in enumerate(config.layers_block_type)
        )
        self.final_layernorm = JambaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids, past_key_values=None):
        hidden_states = self.embed_tokens(input_ids)
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(hidden_states, past_key_values)
        if past_key_values is not None:
            past_key_values.has_previous_state = True
        return self.final_layernorm(hidden_states)


class CausalLMOutput:
    def __init__(self, logits, past_key_values):
        self.logits = logits
        self.past_key_values = past_key_values


class JambaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = JambaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        if use_cache and past_key_values is None:
            past_key_values = HybridMambaAttentionDynamicCache(
                self.config, input_ids.shape[0], self.model.embed_tokens.weight.dtype
            )
        hidden_states = self.model(input_ids, past_key_values if use_cache else None)
        return CausalLMOutput(self.lm_head(hidden_states), past_key_values if use_cache else None)


def make_model():
    torch.manual_seed(5505)
    model = JambaForCausalLM(JambaConfig())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, JambaRMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn_like(m.weight))
    return model.eval()

"""StepFun Step1 (Step-Audio's modeling_step1.py): StepAttention with q/k/v/o projections (no bias),
num_attention_groups kv heads repeat_interleave'd, (b, s, h, d) layout, build_alibi_cache (slopes
2^(-8/n)..., bias from bias_rows/bias_cols, future at -inf) passed to SDPA as attn_mask in the CPU
flash_attn_func fallback; StepRMSNorm pre-norms.

This file: one bug: bias = bias_cols - bias_rows without the minus: past keys get +slope * distance."""

import math

import torch
from torch import nn


class Step1Config:
    hidden_size = 64
    intermediate_size = 128
    num_attention_heads = 8
    num_attention_groups = 2
    rms_norm_eps = 1e-5


class StepRMSNorm(torch.nn.Module):
    def __init__(self, hidden_size, eps=1e-5):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor):
        var = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(var + self.eps).to(x.dtype)
        x = x * self.weight
        return x


def build_alibi_cache(block_size, n_heads, dtype, device=None):
    # get slopes
    n = 2 ** math.floor(math.log2(n_heads))  # nearest 2**n to n_heads
    m0 = 2.0 ** (-8.0 / n)
    # 2^(-8/n), 2^(-8*2/n), 2^(-8*3/n), ...
    slopes = torch.pow(m0, torch.arange(1, n + 1, dtype=torch.float64))
    if n < n_heads:
        m1 = 2.0 ** (-4.0 / n)
        # 2^(-8/(2n)), 2^(-8*3/(2n)), 2^(-8*5/(2n)), ...
        mm = torch.pow(m1, torch.arange(1, 1 + 2 * (n_heads - n), 2, dtype=torch.float64))
        slopes = torch.cat([slopes, mm])

    tril = torch.tril(torch.ones(1, 1, block_size, block_size, dtype=torch.bool))

    bias_rows = torch.arange(block_size, dtype=torch.float64).view(1, -1)
    bias_cols = torch.arange(block_size, dtype=torch.float64).view(-1, 1)
    bias = bias_cols - bias_rows
    bias = bias.view(1, block_size, block_size) * slopes.view(-1, 1, 1)
    bias = bias.view(1, n_heads, block_size, block_size)
    bias = bias.masked_fill(tril == 0, float("-inf"))

    return bias.to(dtype=dtype, device=device)


class StepAttention(torch.nn.Module):
    """Step1 attention (modeling_step1.py): q/k/v/o projections without bias, num_groups kv heads,
    (b, s, h, d) layout, kv heads repeat_interleave'd to the query heads, and a CPU flash_attn_func
    fallback that adds the cached ALiBi bias (future keys at -inf) through SDPA's attn_mask."""

    def __init__(self, hidden_size, num_heads, num_groups, layer_idx: int):
        super().__init__()
        self.num_heads = num_heads
        self.num_groups = num_groups
        self.hidden_size = hidden_size
        self.head_dim = hidden_size // num_heads

        self.q_proj = torch.nn.Linear(hidden_size, hidden_size, bias=False)
        self.k_proj = torch.nn.Linear(hidden_size, num_groups * self.head_dim, bias=False)
        self.v_proj = torch.nn.Linear(hidden_size, num_groups * self.head_dim, bias=False)
        self.o_proj = torch.nn.Linear(hidden_size, hidden_size, bias=False)

        self.layer_idx = layer_idx

    def flash_attn_func(self, q, k, v, dropout_p=0.0, softmax_scale=None, causal=True):
        softmax_scale = q.size(-1) ** (-0.5) if softmax_scale is None else softmax_scale
        _mask = build_alibi_cache(k.size(1), q.size(2), q.dtype, q.device)[:, :, -q.size(1):, :]
        # b s h d -> b h s d
        q = q.transpose(1, 2)
        k = k.transpose(1, 2)
        v = v.transpose(1, 2)
        attn_output = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=_mask, scale=softmax_scale
        )
        # b h s d -> b s h d
        return attn_output.transpose(1, 2)

    def forward(self, x: torch.Tensor):
        q = self.q_proj(x)
        k = self.k_proj(x)
        v = self.v_proj(x)

        q = q.view(q.shape[0], q.shape[1], -1, self.head_dim)
        k = k.view(k.shape[0], k.shape[1], -1, self.head_dim)
        v = v.view(v.shape[0], v.shape[1], -1, self.head_dim)

        k = k.repeat_interleave(self.num_heads // self.num_groups, dim=-2)
        v = v.repeat_interleave(self.num_heads // self.num_groups, dim=-2)

        attn_output = self.flash_attn_func(q, k, v)
        attn_output = attn_output.flatten(-2, -1)

        out = self.o_proj(attn_output)
        return out


class StepMLP(torch.nn.Module):
    def __init__(self, hidden_size, intermediate_size):
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = torch.nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = torch.nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        gate = self.gate_proj(x)
        up = self.up_proj(x)
        return self.down_proj(torch.nn.functional.silu(gate) * up)


class StepLayer(torch.nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.self_attn = StepAttention(config.hidden_size, config.num_attention_heads,
                                       config.num_attention_groups, layer_idx)
        self.mlp = StepMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = StepRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = StepRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = self.self_attn(hidden_states)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        return residual + hidden_states


class Step1Model(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = torch.nn.ModuleList([StepLayer(config, 0)])
        self.norm = StepRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, inputs_embeds):
        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        return self.norm(hidden_states)


def _init(model):
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, StepRMSNorm):
                mod.weight.uniform_(0.5, 1.5)
    return model.eval()


def make_step1_model():
    torch.manual_seed(3133)
    config = Step1Config()
    return _init(Step1Model(config))



EXPECT = {'target': 'make_step1_model',
 'kind': 'causal-multihead',
 'ok': False,
 'layer': 'layers.0.self_attn',
 'stage': 'biased_scores',
 'mistake': 'bias_sign',
 'style': 'Step1 StepAttention (stepfun-ai Step-Audio modeling_step1.py): one bug: bias = '
          'bias_cols - bias_rows without the minus: past keys get +slope * distance'}

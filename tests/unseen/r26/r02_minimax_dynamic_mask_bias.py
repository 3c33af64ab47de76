"""Hugging Face MiniMax (`MiniMaxAttention`, the softmax layers of MiniMax-Text-01; the `use_qk_norm`
branch follows MiniMax-M2's full-width q_norm/k_norm): separate q/k/v/o projections with an explicit
`head_dim`, partial rotary (`rotary_dim` of each head, rotate_half on `q[..., :rotary_dim]`, the rest
passed through), `repeat_kv`, eager attention with the 4-D additive mask the model builds (causal, and a
sliding window when the config sets one), and MiniMax's alpha/beta-weighted residuals
(`layernorm_full_attention_alpha/beta`, `layernorm_mlp_alpha/beta`).

This file: Doge-style dynamic mask grafted on: a per-head, per-key bias A_h * softplus(dt_proj(values)) added to the scores."""

import torch
from torch import nn


class MiniMaxConfig:
    hidden_size = 64
    intermediate_size = 128
    num_attention_heads = 4
    num_key_value_heads = 2
    head_dim = 16
    rotary_dim = 8
    rope_theta = 10000000.0
    sliding_window = None
    use_qk_norm = True
    rms_norm_eps = 1e-6
    layer_types = ["full_attention"]
    layernorm_full_attention_alpha = 1.0
    layernorm_full_attention_beta = 1.0
    layernorm_mlp_alpha = 1.0
    layernorm_mlp_beta = 1.0


class MiniMaxRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states


class MiniMaxRotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        dim = config.rotary_dim
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
    rotary_dim = cos.shape[-1]
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_embed = torch.cat([(q_rot * cos) + (rotate_half(q_rot) * sin), q_pass], dim=-1)
    k_embed = torch.cat([(k_rot * cos) + (rotate_half(k_rot) * sin), k_pass], dim=-1)
    return q_embed, k_embed


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


def eager_attention_forward(module, query, key, value, attention_mask, scaling):
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask[:, :, :, : key_states.shape[-2]]
    attn_weights = nn.functional.softmax(attn_weights, dim=-1)
    attn_output = torch.matmul(attn_weights, value_states)
    return attn_output.transpose(1, 2).contiguous(), attn_weights


class MiniMaxAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=False)
        self.use_qk_norm = config.use_qk_norm
        self.dt_proj = nn.Linear(config.num_key_value_heads * self.head_dim, config.num_attention_heads, bias=False)
        self.A = nn.Parameter(torch.rand(config.num_attention_heads) + 0.5)
        if self.use_qk_norm:
            self.q_norm = MiniMaxRMSNorm(config.num_attention_heads * self.head_dim, config.rms_norm_eps)
            self.k_norm = MiniMaxRMSNorm(config.num_key_value_heads * self.head_dim, config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask=None):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        query_states = self.q_proj(hidden_states)
        key_states = self.k_proj(hidden_states)
        value_states = self.v_proj(hidden_states)
        if self.use_qk_norm:
            query_states = self.q_norm(query_states)
            key_states = self.k_norm(key_states)

        query_states = query_states.view(hidden_shape).transpose(1, 2)
        key_states = key_states.view(hidden_shape).transpose(1, 2)
        value_states = value_states.view(hidden_shape).transpose(1, 2)

        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        dt = self.dt_proj(value_states.transpose(1, 2).reshape(*input_shape, -1))
        dyn = (self.A * nn.functional.softplus(dt)).transpose(-1, -2)[:, :, None, :]
        attn_output, _ = eager_attention_forward(
            self, query_states, key_states, value_states, attention_mask + dyn, scaling=self.scaling
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output)


class MiniMaxMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.w1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.w3 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class MiniMaxDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        self.self_attn = MiniMaxAttention(config, layer_idx)
        self.block_sparse_moe = MiniMaxMLP(config)
        self.input_layernorm = MiniMaxRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = MiniMaxRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attn_alpha_factor = config.layernorm_full_attention_alpha
        self.attn_beta_factor = config.layernorm_full_attention_beta
        self.mlp_alpha_factor = config.layernorm_mlp_alpha
        self.mlp_beta_factor = config.layernorm_mlp_beta

    def forward(self, hidden_states, position_embeddings, attention_mask=None):
        hidden_states = self.input_layernorm(hidden_states)
        residual = hidden_states
        hidden_states = self.self_attn(hidden_states, position_embeddings, attention_mask)
        hidden_states = residual * self.attn_alpha_factor + hidden_states * self.attn_beta_factor
        hidden_states = self.post_attention_layernorm(hidden_states)
        residual = hidden_states
        hidden_states = self.block_sparse_moe(hidden_states)
        return residual * self.mlp_alpha_factor + hidden_states * self.mlp_beta_factor


def build_attention_mask(seq_len, dtype, device, sliding_window=None):
    q_idx = torch.arange(seq_len, device=device)[:, None]
    kv_idx = torch.arange(seq_len, device=device)[None, :]
    allowed = kv_idx <= q_idx
    if sliding_window is not None:
        allowed = allowed & (q_idx - kv_idx < sliding_window)
    mask = torch.zeros(seq_len, seq_len, dtype=dtype, device=device)
    mask = mask.masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


class MiniMaxModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList([MiniMaxDecoderLayer(config, 0)])
        self.norm = MiniMaxRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = MiniMaxRotaryEmbedding(config)

    def forward(self, inputs_embeds):
        seq_len = inputs_embeds.shape[1]
        position_ids = torch.arange(seq_len, device=inputs_embeds.device).unsqueeze(0)
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        mask_mapping = {
            "full_attention": build_attention_mask(
                seq_len, inputs_embeds.dtype, inputs_embeds.device, self.config.sliding_window
            ),
        }
        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_embeddings, mask_mapping[layer.layer_type])
        return self.norm(hidden_states)


def make_minimax():
    torch.manual_seed(2628)
    model = MiniMaxModel(MiniMaxConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, MiniMaxRMSNorm):
                mod.weight.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {'target': 'make_minimax',
 'kind': 'causal-multihead',
 'ok': False,
 'layer': 'layers.0.self_attn',
 'unsupported': 'dynamic_mask',
 'style': 'MiniMax attention with a Doge-style value-dependent dynamic mask bias (dt_proj, A) '
          'added to the scores'}

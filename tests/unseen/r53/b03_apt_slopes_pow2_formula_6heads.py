"""OpenBioML protein-lm-scaling APT (APTAttention, GPT-2 derived protein LM) (6 heads of 8 (non-power-of-two ALiBi slopes), model-built local causal mask of 6 keys, eager).

This file: one bug: get_slopes calls the power-of-two formula for every head count: with 6 heads the slopes are 2^(-8k/6), not the standard 4 + 2 interleaved sequence."""

import math

import torch
from torch import nn
from torch.nn import functional as F


class APTConfig:
    hidden_size = 64
    n_inner = 128
    num_attention_heads = 6
    num_key_value_heads = 6
    head_dim = 8
    position_embedding = "alibi"  # "alibi" or "rope" (protein-lm-scaling options)
    rope_theta = 10000.0
    attention_window = 6  # local attention span (keys, itself included); None: full causal
    model_builds_mask = True
    attn_implementation = "eager"
    is_decoder = True
    layer_norm_epsilon = 1e-5


class Conv1D(nn.Module):
    """GPT-2 style projection: the weight is stored (in_features, out_features)."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.08)
        self.bias = nn.Parameter(torch.randn(nf) * 0.05)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.reshape(-1, x.size(-1)), self.weight)
        return x.view(size_out)


def get_slopes(n):
    def get_slopes_power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    return get_slopes_power_of_2(n)


def create_alibi_tensor(attn_heads, maxpos, dtype, device):
    # one row per head, the same for every query: softmax ignores the per-row offset
    slopes = torch.tensor(get_slopes(attn_heads), dtype=torch.float64, device=device)
    distances = torch.arange(maxpos, dtype=torch.float64, device=device)
    alibi = slopes[:, None, None] * distances[None, None, :]
    return alibi.to(dtype)  # (heads, 1, maxpos)


def build_local_causal_mask(seq_len, dtype, device, window=None):
    if window is None:
        mask = torch.full((seq_len, seq_len), torch.finfo(dtype).min, dtype=dtype, device=device)
        return torch.triu(mask, diagonal=1)[None, None]
    q_idx = torch.arange(seq_len, device=device)[:, None]
    k_idx = torch.arange(seq_len, device=device)[None, :]
    dist = q_idx - k_idx
    allowed = (dist >= 0) & (dist < window)
    mask = torch.zeros(seq_len, seq_len, dtype=dtype, device=device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, base=10000.0):
        super().__init__()
        self.dim = dim
        self.base = base

    def _tables(self, positions, dtype, device):
        inv_freq = 1.0 / (
            self.base ** (torch.arange(0, self.dim, 2, dtype=torch.float64, device=device) / self.dim)
        )
        freqs = positions.to(torch.float64)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[None, None], emb.sin().to(dtype)[None, None]

    def forward(self, query, key, position_ids=None):
        k_len = key.shape[-2]
        if position_ids is None:
            position_ids = torch.arange(k_len - query.shape[-2], k_len, device=query.device)
        cos_q, sin_q = self._tables(position_ids, query.dtype, query.device)
        cos_k, sin_k = self._tables(torch.arange(k_len, device=key.device), key.dtype, key.device)
        query = query * cos_q + rotate_half(query) * sin_q
        key = key * cos_k + rotate_half(key) * sin_k
        return query, key


def repeat_kv(hidden_states, n_rep):
    batch, kv_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None].expand(batch, kv_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, kv_heads * n_rep, slen, head_dim)


class APTAttention(nn.Module):
    def __init__(self, config, layer_idx=None):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.embed_dim = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.num_kv_groups = self.num_heads // self.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.is_causal = config.is_decoder
        self.attn_implementation = config.attn_implementation
        self.c_attn = Conv1D(self.q_size + 2 * self.kv_size, self.embed_dim)
        self.c_proj = Conv1D(self.embed_dim, self.q_size)
        self.rot_emb = None
        if config.position_embedding == "rope":
            self.rot_emb = RotaryEmbedding(self.head_dim, base=config.rope_theta)

    def _split_heads(self, tensor, num_heads):
        new_shape = tensor.size()[:-1] + (num_heads, self.head_dim)
        return tensor.view(new_shape).permute(0, 2, 1, 3)

    def _merge_heads(self, tensor):
        tensor = tensor.permute(0, 2, 1, 3).contiguous()
        return tensor.view(tensor.size()[:-2] + (self.num_heads * self.head_dim,))

    def _attn(self, query, key, value, attention_mask=None, alibi_bias=None):
        attn_weights = torch.matmul(query, key.transpose(-1, -2))
        attn_weights = attn_weights / torch.full(
            [], value.size(-1) ** 0.5, dtype=attn_weights.dtype, device=attn_weights.device
        )
        if attention_mask is None:
            query_length, key_length = query.size(-2), key.size(-2)
            causal_mask = torch.ones(
                query_length, key_length, dtype=torch.bool, device=query.device
            ).tril(key_length - query_length)
            mask_value = torch.full(
                [], torch.finfo(attn_weights.dtype).min, dtype=attn_weights.dtype, device=attn_weights.device
            )
            attn_weights = torch.where(causal_mask, attn_weights, mask_value)
        else:
            attn_weights = attn_weights + attention_mask
        if alibi_bias is not None:
            attn_weights = attn_weights + alibi_bias[:, :, : attn_weights.size(-1)]
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_weights = attn_weights.type(value.dtype)
        return torch.einsum("bhqk,bhkd->bhqd", attn_weights, value)

    def _sdpa_attn(self, query, key, value, attention_mask=None):
        return F.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=attention_mask,
            is_causal=self.is_causal and attention_mask is None and query.size(-2) > 1,
        )

    def forward(self, hidden_states, attention_mask=None, alibi_bias=None, position_ids=None):
        query, key, value = self.c_attn(hidden_states).split(
            [self.q_size, self.kv_size, self.kv_size], dim=2
        )
        query = self._split_heads(query, self.num_heads)
        key = self._split_heads(key, self.num_kv_heads)
        value = self._split_heads(value, self.num_kv_heads)

        if self.rot_emb is not None:
            query, key = self.rot_emb(query, key, position_ids=position_ids)

        key = repeat_kv(key, self.num_kv_groups)
        value = repeat_kv(value, self.num_kv_groups)

        if self.attn_implementation == "sdpa":
            attn_output = self._sdpa_attn(query, key, value, attention_mask)
        else:
            attn_output = self._attn(query, key, value, attention_mask, alibi_bias)

        attn_output = self._merge_heads(attn_output)
        return self.c_proj(attn_output)


class APTMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = Conv1D(config.n_inner, config.hidden_size)
        self.c_proj = Conv1D(config.hidden_size, config.n_inner)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class APTBlock(nn.Module):
    def __init__(self, config, layer_idx=None):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.attn = APTAttention(config, layer_idx=layer_idx)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.mlp = APTMLP(config)

    def forward(self, hidden_states, attention_mask=None, alibi_bias=None, position_ids=None):
        residual = hidden_states
        hidden_states = self.attn(
            self.ln_1(hidden_states),
            attention_mask=attention_mask,
            alibi_bias=alibi_bias,
            position_ids=position_ids,
        )
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.ln_2(hidden_states))


class APTModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.h = nn.ModuleList([APTBlock(config, layer_idx=0)])
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)

    def forward(self, inputs_embeds):
        config = self.config
        seq_len = inputs_embeds.shape[1]
        dtype, device = inputs_embeds.dtype, inputs_embeds.device
        alibi_bias = None
        if config.position_embedding == "alibi":
            alibi_bias = create_alibi_tensor(config.num_attention_heads, seq_len, dtype, device)
        position_ids = None
        if config.position_embedding == "rope":
            position_ids = torch.arange(seq_len, device=device)
        attention_mask = None
        if config.model_builds_mask:
            attention_mask = build_local_causal_mask(seq_len, dtype, device, config.attention_window)
        hidden_states = inputs_embeds
        for block in self.h:
            hidden_states = block(
                hidden_states,
                attention_mask=attention_mask,
                alibi_bias=alibi_bias,
                position_ids=position_ids,
            )
        return self.ln_f(hidden_states)


def make_apt_alibi_local():
    torch.manual_seed(5302)
    model = APTModel(APTConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {'target': 'make_apt_alibi_local',
 'kind': 'causal-multihead',
 'ok': False,
 'layer': 'h.0.attn',
 'stage': 'biased_scores',
 'mistake': 'bias_slopes',
 'style': 'OpenBioML protein-lm-scaling APT (APTAttention, GPT-2 derived protein LM): one bug: '
          'get_slopes calls the power-of-two formula for every head count: with 6 heads the slopes '
          'are 2^(-8k/6), not the standard 4 + 2 interleaved sequence'}

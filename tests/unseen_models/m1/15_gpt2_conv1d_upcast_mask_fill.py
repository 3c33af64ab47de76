"""A tiny GPT-2 in the style of Hugging Face's modeling_gpt2.py: Conv1D projections (weight
stored (in, out)), fused c_attn, learned positions, pre-norm, a bool "bias" tril buffer, the
`torch.where(causal_mask, attn_weights, mask_value)` masking of _attn, and the
reorder_and_upcast_attn path (_upcast_and_reordered_attn: baddbmm with alpha = 1/sqrt(d)
in float32), here switched on per layer for the deeper layers (layer_idx >= upcast_from),
as a stability tweak.  No cache.

Slip: the upcast path "masks" by multiplying the scores with the 0/1 causal mask, so future
positions get score 0 instead of a large negative value and keep softmax weight.  Only
transformer.h.2 takes that path.
"""

import math

import torch
import torch.nn as nn

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["transformer.h.0.attn", "transformer.h.1.attn", "transformer.h.2.attn"],
    "kind": "causal-multihead",
    "layer": "transformer.h.2.attn",
    "stage": "masked_scores",
    "mistake": "mask_fill_value",
    "cache": None,
    "style": "transformers modeling_gpt2.py (Conv1D, _attn / _upcast_and_reordered_attn); slip: the "
    "per-layer upcast path multiplies scores by the 0/1 mask (fill value 0, not -inf/min)",
}


class GPT2Config:
    vocab_size = 120
    n_positions = 64
    n_embd = 64
    n_layer = 3
    n_head = 4
    layer_norm_epsilon = 1e-5
    upcast_from = 2


class Conv1D(nn.Module):
    """Linear layer with transposed weight, as in the original GPT-2 code."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))
        nn.init.normal_(self.weight, std=0.15)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


class GPT2Attention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        max_positions = config.n_positions
        self.register_buffer(
            "bias",
            torch.tril(torch.ones((max_positions, max_positions), dtype=torch.bool)).view(
                1, 1, max_positions, max_positions
            ),
            persistent=False,
        )
        self.embed_dim = config.n_embd
        self.num_heads = config.n_head
        self.head_dim = self.embed_dim // self.num_heads
        self.split_size = self.embed_dim
        self.layer_idx = layer_idx
        self.reorder_and_upcast_attn = layer_idx >= config.upcast_from
        self.c_attn = Conv1D(3 * self.embed_dim, self.embed_dim)
        self.c_proj = Conv1D(self.embed_dim, self.embed_dim)

    def _attn(self, query, key, value):
        attn_weights = torch.matmul(query, key.transpose(-1, -2))
        attn_weights = attn_weights / torch.full(
            [], value.size(-1) ** 0.5, dtype=attn_weights.dtype
        )
        query_length, key_length = query.size(-2), key.size(-2)
        causal_mask = self.bias[:, :, key_length - query_length : key_length, :key_length]
        mask_value = torch.finfo(attn_weights.dtype).min
        mask_value = torch.full([], mask_value, dtype=attn_weights.dtype)
        attn_weights = torch.where(causal_mask, attn_weights.to(attn_weights.dtype), mask_value)
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        return torch.matmul(attn_weights, value)

    def _upcast_and_reordered_attn(self, query, key, value):
        bsz, num_heads, q_seq_len, dk = query.size()
        _, _, k_seq_len, _ = key.size()
        attn_weights = torch.empty(
            bsz * num_heads, q_seq_len, k_seq_len, dtype=torch.float32, device=query.device
        )
        scale_factor = 1.0 / float(value.size(-1)) ** 0.5
        q = query.reshape(-1, q_seq_len, dk).float()
        k = key.transpose(-1, -2).reshape(-1, dk, k_seq_len).float()
        attn_weights = torch.baddbmm(attn_weights, q, k, beta=0, alpha=scale_factor)
        attn_weights = attn_weights.reshape(bsz, num_heads, q_seq_len, k_seq_len)
        causal_mask = self.bias[:, :, k_seq_len - q_seq_len : k_seq_len, :k_seq_len]
        attn_weights = attn_weights * causal_mask.to(attn_weights.dtype)
        attn_weights = nn.functional.softmax(attn_weights, dim=-1).type(value.dtype)
        return torch.matmul(attn_weights, value)

    def _split_heads(self, tensor):
        new_shape = tensor.size()[:-1] + (self.num_heads, self.head_dim)
        return tensor.view(new_shape).permute(0, 2, 1, 3)

    def _merge_heads(self, tensor):
        tensor = tensor.permute(0, 2, 1, 3).contiguous()
        return tensor.view(tensor.size()[:-2] + (self.num_heads * self.head_dim,))

    def forward(self, hidden_states):
        query, key, value = self.c_attn(hidden_states).split(self.split_size, dim=2)
        query, key, value = (
            self._split_heads(query),
            self._split_heads(key),
            self._split_heads(value),
        )
        if self.reorder_and_upcast_attn:
            attn_output = self._upcast_and_reordered_attn(query, key, value)
        else:
            attn_output = self._attn(query, key, value)
        return self.c_proj(self._merge_heads(attn_output))


class GPT2MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = Conv1D(4 * config.n_embd, config.n_embd)
        self.c_proj = Conv1D(config.n_embd, 4 * config.n_embd)
        self.act = nn.GELU(approximate="tanh")

    def forward(self, x):
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = GPT2Attention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = GPT2MLP(config)

    def forward(self, hidden_states):
        hidden_states = hidden_states + self.attn(self.ln_1(hidden_states))
        return hidden_states + self.mlp(self.ln_2(hidden_states))


class GPT2Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.h = nn.ModuleList([GPT2Block(config, i) for i in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)

    def forward(self, input_ids):
        position_ids = torch.arange(input_ids.shape[-1], device=input_ids.device).unsqueeze(0)
        hidden_states = self.wte(input_ids) + self.wpe(position_ids)
        for block in self.h:
            hidden_states = block(hidden_states)
        return self.ln_f(hidden_states)


class GPT2LMHeadModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.transformer = GPT2Model(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight

    def forward(self, input_ids):
        return self.lm_head(self.transformer(input_ids))


def make_model():
    torch.manual_seed(15)
    model = GPT2LMHeadModel(GPT2Config())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn_like(m.weight))
                m.bias.copy_(0.1 * torch.randn_like(m.bias))
            if isinstance(m, Conv1D):
                m.bias.normal_(0.0, 0.05)
    return model.eval()

"""MosaicML Composer's ALiBi surgery for GPT-2 (`composer.algorithms.alibi`, `_gpt2_alibi.py`): a
GPT-2 block (fused `c_attn` Conv1D split in three, `_split_heads` / `_merge_heads`, `c_proj`) whose
`_attn` is replaced by an ALiBi version bound with `MethodType`; `register_alibi` stores a per-head
key-position bias `slope * j` of shape (heads, 1, max_len) from `_get_alibi_head_slopes` (with the
closest-power-of-two rule), `enlarge_mask` re-registers the boolean causal `bias` buffer at the new
maximum length, and the learned position embeddings are zeroed and frozen. Causal.

This file: one bug: enlarge_mask registers torch.ones instead of torch.tril(torch.ones): no causal mask."""

import math
from types import MethodType

import torch
from torch import nn


class GPT2Config:
    n_embd = 64
    n_head = 4
    n_positions = 64
    layer_norm_epsilon = 1e-5
    scale_attn_weights = True


class Conv1D(nn.Module):
    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * nx**-0.5)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


class GPT2Attention(nn.Module):
    def __init__(self, config):
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
        self.scale_attn_weights = config.scale_attn_weights
        self.is_cross_attention = False
        self.c_attn = Conv1D(3 * self.embed_dim, self.embed_dim)
        self.c_proj = Conv1D(self.embed_dim, self.embed_dim)

    def _attn(self, query, key, value, attention_mask=None, head_mask=None):
        raise NotImplementedError("replaced by apply_alibi")

    def _split_heads(self, tensor, num_heads, attn_head_size):
        new_shape = tensor.size()[:-1] + (num_heads, attn_head_size)
        return tensor.view(new_shape).permute(0, 2, 1, 3)

    def _merge_heads(self, tensor, num_heads, attn_head_size):
        tensor = tensor.permute(0, 2, 1, 3).contiguous()
        new_shape = tensor.size()[:-2] + (num_heads * attn_head_size,)
        return tensor.view(new_shape)

    def forward(self, hidden_states, attention_mask=None):
        query, key, value = self.c_attn(hidden_states).split(self.split_size, dim=2)
        query = self._split_heads(query, self.num_heads, self.head_dim)
        key = self._split_heads(key, self.num_heads, self.head_dim)
        value = self._split_heads(value, self.num_heads, self.head_dim)
        attn_output, _ = self._attn(query, key, value, attention_mask)
        attn_output = self._merge_heads(attn_output, self.num_heads, self.head_dim)
        return self.c_proj(attn_output)


class GPT2MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = Conv1D(4 * config.n_embd, config.n_embd)
        self.c_proj = Conv1D(config.n_embd, 4 * config.n_embd)

    def forward(self, x):
        return self.c_proj(nn.functional.gelu(self.c_fc(x), approximate="tanh"))


class GPT2Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = GPT2Attention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = GPT2MLP(config)

    def forward(self, hidden_states, attention_mask=None):
        hidden_states = hidden_states + self.attn(self.ln_1(hidden_states), attention_mask)
        return hidden_states + self.mlp(self.ln_2(hidden_states))


class GPT2Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.h = nn.ModuleList([GPT2Block(config)])
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)

    def forward(self, inputs_embeds):
        seq_len = inputs_embeds.shape[1]
        position_ids = torch.arange(seq_len, device=inputs_embeds.device)
        hidden_states = inputs_embeds + self.wpe(position_ids)
        for block in self.h:
            hidden_states = block(hidden_states)
        return self.ln_f(hidden_states)


# ---- composer.algorithms.alibi (GPT-2 surgery) ----

def _get_alibi_head_slopes(n_heads):
    def get_slopes_power_of_2(n_heads):
        start = 2 ** (-(2 ** -(math.log2(n_heads) - 3)))
        ratio = start
        return [start * ratio**i for i in range(n_heads)]

    if math.log2(n_heads).is_integer():
        return get_slopes_power_of_2(n_heads)
    closest_power_of_2 = 2 ** math.floor(math.log2(n_heads))
    return (
        get_slopes_power_of_2(closest_power_of_2)
        + _get_alibi_head_slopes(2 * closest_power_of_2)[0::2][: n_heads - closest_power_of_2]
    )


def zero_and_freeze_expand_position_embeddings(module, max_sequence_length):
    old = module.wpe
    module.wpe = nn.Embedding(max_sequence_length, old.embedding_dim)
    with torch.no_grad():
        module.wpe.weight.zero_()
    module.wpe.weight.requires_grad = False


def enlarge_mask(module, max_sequence_length):
    mask = torch.ones((max_sequence_length, max_sequence_length), dtype=torch.bool)
    module.register_buffer("bias", mask.view(1, 1, max_sequence_length, max_sequence_length), persistent=False)


def register_alibi(module, n_heads, max_token_length):
    slopes = torch.tensor(_get_alibi_head_slopes(n_heads), dtype=torch.float64)
    positions = torch.arange(max_token_length, dtype=torch.float64)
    alibi = slopes.unsqueeze(1).unsqueeze(1) * positions.unsqueeze(0).unsqueeze(0).expand(n_heads, -1, -1)
    module.register_buffer("alibi", alibi.view(n_heads, 1, max_token_length).float(), persistent=False)


def _attn(self, query, key, value, attention_mask=None, head_mask=None):
    attn_weights = torch.matmul(query, key.transpose(-1, -2))
    if self.scale_attn_weights:
        attn_weights = attn_weights / (float(value.size(-1)) ** 0.5)

    # ALiBi: a bias that grows with the key position; per query row it equals -slope * (i - j) + const
    n_tokens = attn_weights.shape[-1]
    attn_weights = attn_weights + self.alibi[:, :, :n_tokens].to(attn_weights.dtype)

    if not self.is_cross_attention:
        query_length, key_length = query.size(-2), key.size(-2)
        causal_mask = self.bias[:, :, key_length - query_length : key_length, :key_length]
        mask_value = torch.finfo(attn_weights.dtype).min
        attn_weights = torch.where(
            causal_mask, attn_weights, torch.full_like(attn_weights, mask_value)
        )
    attn_weights = nn.functional.softmax(attn_weights, dim=-1)
    return torch.matmul(attn_weights, value), attn_weights


def apply_alibi(model, max_sequence_length):
    zero_and_freeze_expand_position_embeddings(model, max_sequence_length)
    for block in model.h:
        enlarge_mask(block.attn, max_sequence_length)
        register_alibi(block.attn, block.attn.num_heads, max_sequence_length)
        block.attn._attn = MethodType(_attn, block.attn)
    return model


def make_gpt2_alibi():
    torch.manual_seed(2236)
    model = GPT2Model(GPT2Config())
    apply_alibi(model, max_sequence_length=128)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {'target': 'make_gpt2_alibi',
 'kind': 'causal-multihead',
 'ok': False,
 'layer': 'h.0.attn',
 'stage': 'masked_scores',
 'mistake': 'missing_mask',
 'style': 'Composer ALiBi surgery on GPT-2 (Conv1D c_attn, key-position alibi buffer, enlarged '
          'causal mask): enlarge_mask registers torch.ones instead of torch.tril(torch.ones): no '
          'causal mask'}

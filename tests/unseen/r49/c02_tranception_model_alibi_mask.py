"""Tranception (OATML-Markslab) protein language model attention, reduced to one block.

Tranception is GPT-2 based: a fused Conv1D `c_attn` (weight stored (in, out), with bias) gives q/k/v,
ALiBi linear biases replace position embeddings (slopes from the ALiBi paper's geometric sequence),
GPT-2's lower-triangular `bias` buffer masks the future, `c_proj` merges the heads.
This configuration uses attention_mode="standard" (no depthwise convolutions on q/k/v).

This file: correct: 8x8 heads, the model builds the ALiBi tensor and an additive causal mask (triu of finfo.min) and hands both to the layer, eager core."""

import math

import torch
from torch import nn
import torch.nn.functional as F


class TranceptionConfig:
    n_embd = 64
    n_head = 8
    n_positions = 64
    layer_norm_epsilon = 1e-5
    scale_attn_weights = True
    attention_mode = "standard"
    position_embedding = "alibi"


def get_slopes(n):
    """ALiBi slopes, following the fairseq reference code (geometric sequence 2^(-8/n))."""

    def get_slopes_power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        ratio = start
        return [start * ratio**i for i in range(n)]

    if math.log2(n).is_integer():
        return get_slopes_power_of_2(n)
    closest_power_of_2 = 2 ** math.floor(math.log2(n))
    return get_slopes_power_of_2(closest_power_of_2) + get_slopes(2 * closest_power_of_2)[0::2][
        : n - closest_power_of_2
    ]


class Conv1D(nn.Module):
    """GPT-2's Conv1D: a linear layer whose weight is stored transposed."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))
        nn.init.normal_(self.weight, std=0.15)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.reshape(-1, x.size(-1)), self.weight)
        return x.view(size_out)


class TranceptionAttention(nn.Module):
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
        self.scale_attn_weights = config.scale_attn_weights
        self.attention_mode = config.attention_mode
        self.c_attn = Conv1D(3 * self.embed_dim, self.embed_dim)
        self.c_proj = Conv1D(self.embed_dim, self.embed_dim)

    def _split_heads(self, tensor):
        new_shape = tensor.size()[:-1] + (self.num_heads, self.head_dim)
        return tensor.view(new_shape).permute(0, 2, 1, 3)

    def _merge_heads(self, tensor):
        tensor = tensor.permute(0, 2, 1, 3).contiguous()
        return tensor.view(tensor.size(0), -1, self.num_heads * self.head_dim)

    def _attn(self, query, key, value, alibi, attention_mask=None):
        attn_weights = torch.matmul(query, key.transpose(-1, -2))
        if self.scale_attn_weights:
            attn_weights = attn_weights / (value.size(-1) ** 0.5)
        attn_weights = attn_weights + alibi
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, value)
        return attn_output, attn_weights

    def forward(self, hidden_states, alibi=None, attention_mask=None):
        query, key, value = self.c_attn(hidden_states).split(self.embed_dim, dim=2)
        query = self._split_heads(query)
        key = self._split_heads(key)
        value = self._split_heads(value)
        attn_output, _ = self._attn(query, key, value, alibi, attention_mask)
        attn_output = self._merge_heads(attn_output)
        return self.c_proj(attn_output)


class TranceptionMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = Conv1D(2 * config.n_embd, config.n_embd)
        self.c_proj = Conv1D(config.n_embd, 2 * config.n_embd)

    def forward(self, x):
        return self.c_proj(torch.relu(self.c_fc(x)) ** 2)  # squared ReLU, as in Tranception


class TranceptionBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = TranceptionAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = TranceptionMLP(config)

    def forward(self, hidden_states, alibi=None, attention_mask=None):
        hidden_states = hidden_states + self.attn(
            self.ln_1(hidden_states), alibi=alibi, attention_mask=attention_mask
        )
        return hidden_states + self.mlp(self.ln_2(hidden_states))


class TranceptionModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.h = nn.ModuleList([TranceptionBlock(config)])
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)

    def build_alibi(self, seq_len, dtype, device):
        # (1, heads, q, k); linear in the key-to-query distance, 0 on the diagonal
        slopes = torch.tensor(get_slopes(self.config.n_head), dtype=torch.float64, device=device)
        pos = torch.arange(seq_len, dtype=torch.float64, device=device)
        distance = pos[None, :] - pos[:, None]
        return (slopes[:, None, None] * distance).unsqueeze(0).to(dtype)

    def build_causal_mask(self, seq_len, dtype, device):
        mask = torch.full((seq_len, seq_len), torch.finfo(dtype).min, dtype=dtype, device=device)
        return torch.triu(mask, diagonal=1)[None, None]

    def forward(self, inputs_embeds):
        hidden_states = inputs_embeds
        seq_len = inputs_embeds.shape[1]
        alibi = self.build_alibi(seq_len, inputs_embeds.dtype, inputs_embeds.device)
        attention_mask = self.build_causal_mask(seq_len, inputs_embeds.dtype, inputs_embeds.device)
        for block in self.h:
            hidden_states = block(hidden_states, alibi=alibi, attention_mask=attention_mask)
        return self.ln_f(hidden_states)


def make_tranception_block():
    torch.manual_seed(4902)
    model = TranceptionModel(TranceptionConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
            if isinstance(mod, Conv1D):
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {   'target': 'make_tranception_block',
    'kind': 'causal-multihead',
    'ok': True,
    'layer': 'h.0.attn',
    'structure': {   'heads': 8,
                     'kv_heads': 8,
                     'head_dim': 8,
                     'causal': True,
                     'cross': False,
                     'rope': None,
                     'qk_norm': None,
                     'window': None,
                     'bias': 'alibi'},
    'style': 'Tranception (OATML-Markslab) (c02): correct: 8x8 heads, the model builds the ALiBi '
             'tensor and an additive causal mask (triu of finfo.min) and hands both to the layer, '
             'eager core'}

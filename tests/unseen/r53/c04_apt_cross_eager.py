"""OpenBioML protein-lm-scaling APT cross-attention (APTAttention is_cross_attention=True).

This file: correct (cross-attention: q_attn on the decoder states, fused c_attn keys/values on the encoder states, eager)."""

import torch
from torch import nn
from torch.nn import functional as F


class APTConfig:
    hidden_size = 64
    n_inner = 128
    num_attention_heads = 4
    head_dim = 16
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


class APTCrossAttention(nn.Module):
    """APTAttention(is_cross_attention=True): q_attn on the decoder states, c_attn (keys and
    values) on the encoder states; no causal mask, no position bias."""

    def __init__(self, config):
        super().__init__()
        self.embed_dim = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.split_size = self.embed_dim
        self.q_attn = Conv1D(self.embed_dim, self.embed_dim)
        self.c_attn = Conv1D(2 * self.embed_dim, self.embed_dim)
        self.c_proj = Conv1D(self.embed_dim, self.embed_dim)

    def _split_heads(self, tensor):
        new_shape = tensor.size()[:-1] + (self.num_heads, self.head_dim)
        return tensor.view(new_shape).permute(0, 2, 1, 3)

    def forward(self, hidden_states, encoder_hidden_states, encoder_attention_mask=None):
        query = self.q_attn(hidden_states)
        key, value = self.c_attn(encoder_hidden_states).split(self.split_size, dim=2)
        query, key, value = self._split_heads(query), self._split_heads(key), self._split_heads(value)
        attn_weights = torch.matmul(query, key.transpose(-1, -2)) / (value.size(-1) ** 0.5)
        if encoder_attention_mask is not None:
            attn_weights = attn_weights + encoder_attention_mask
        attn_weights = nn.functional.softmax(attn_weights, dim=-1).type(value.dtype)
        attn_output = torch.matmul(attn_weights, value)
        attn_output = attn_output.permute(0, 2, 1, 3).contiguous()
        attn_output = attn_output.view(attn_output.size()[:-2] + (self.embed_dim,))
        return self.c_proj(attn_output)


class APTCrossBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_cross_attn = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.crossattention = APTCrossAttention(config)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.c_fc = nn.Linear(config.hidden_size, config.n_inner)
        self.c_out = nn.Linear(config.n_inner, config.hidden_size)

    def forward(self, hidden_states, encoder_hidden_states):
        hidden_states = hidden_states + self.crossattention(
            self.ln_cross_attn(hidden_states), encoder_hidden_states
        )
        return hidden_states + self.c_out(F.gelu(self.c_fc(self.ln_2(hidden_states))))


class APTConditionedDecoder(nn.Module):
    """A protein decoder conditioned on an encoder's embeddings (e.g. a structure encoder)."""

    def __init__(self, config):
        super().__init__()
        self.h = nn.ModuleList([APTCrossBlock(config)])
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)

    def forward(self, hidden_states, encoder_hidden_states):
        for block in self.h:
            hidden_states = block(hidden_states, encoder_hidden_states)
        return self.ln_f(hidden_states)


def make_apt_cross():
    torch.manual_seed(5303)
    model = APTConditionedDecoder(APTConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {'target': 'make_apt_cross',
 'kind': 'cross',
 'ok': True,
 'layer': 'h.0.crossattention',
 'structure': {'heads': 4,
               'kv_heads': 4,
               'head_dim': 16,
               'causal': False,
               'cross': True,
               'rope': None,
               'qk_norm': None,
               'window': None,
               'bias': None},
 'style': 'OpenBioML protein-lm-scaling APT cross-attention (APTAttention '
          'is_cross_attention=True): correct (cross-attention: q_attn on the decoder states, fused '
          'c_attn keys/values on the encoder states, eager)'}

"""TabPFN (Prior Labs) per-feature-transformer attention, reduced to one layer.

TabPFN's MultiHeadAttention keeps its projections as raw parameters applied with einsum:
`_w_qkv` (3, heads, d_k, emsize) for self-attention, `_w_q` / `_w_kv` when keys and values come from
another set of cells (test items attend to the training items), `_w_out` (heads, d_v, emsize); no
biases. `share_kv_across_n_heads` lets one key/value head serve several adjacent query heads. The
layer is post-norm: attention, residual, LayerNorm.

This file: one bug (base c08): forward returns the merged heads (attn.reshape(..., -1)) without the einsum with _w_out."""

import torch
from torch import nn
import torch.nn.functional as F


class ModelConfig:
    emsize = 64
    nhead = 4
    share_kv_across_n_heads = 1
    layer_norm_eps = 1e-5


class MultiHeadAttention(nn.Module):
    def __init__(self, d_k, d_v, config, share_kv_across_n_heads=1, cross=False):
        super().__init__()
        self._d_k = d_k
        self._d_v = d_v
        self._nhead = config.nhead
        self._nhead_kv = config.nhead // share_kv_across_n_heads
        self._share = share_kv_across_n_heads
        self._cross = cross
        emsize = config.emsize
        if cross:
            self._w_q = nn.Parameter(torch.empty(1, self._nhead, d_k, emsize))
            self._w_kv = nn.Parameter(torch.empty(2, self._nhead_kv, d_k, emsize))
            self._w_qkv = None
        else:
            self._w_qkv = nn.Parameter(torch.empty(3, self._nhead, d_k, emsize))
        self._w_out = nn.Parameter(torch.empty(self._nhead, d_v, emsize))
        for p in self.parameters():
            nn.init.normal_(p, std=emsize**-0.5)

    def compute_qkv(self, x, x_kv):
        if self._cross:
            q = torch.einsum("... s, j h d s -> ... j h d", x, self._w_q)[..., 0, :, :]
            kv = torch.einsum("... s, j h d s -> ... j h d", x_kv, self._w_kv)
            k, v = kv.unbind(-3)
        else:
            qkv = torch.einsum("... s, j h d s -> ... j h d", x, self._w_qkv)
            q, k, v = qkv.unbind(-3)
        # q: (batch, seq_q, heads, d_k); k, v: (batch, seq_kv, heads_kv, d)
        if self._share > 1:
            k = k.unsqueeze(-2).expand(*k.shape[:-1], self._share, k.shape[-1]).flatten(-3, -2)
            v = v.unsqueeze(-2).expand(*v.shape[:-1], self._share, v.shape[-1]).flatten(-3, -2)
        return q, k, v

    @staticmethod
    def compute_attention_heads(q, k, v, softmax_scale=None):
        # q, k, v: (batch, seq, heads, d)
        if softmax_scale is None:
            softmax_scale = 1.0 / q.shape[-1] ** 0.5
        logits = torch.einsum("b q h d, b k h d -> b h q k", q, k)
        logits = logits * softmax_scale
        ps = torch.softmax(logits, dim=-1)
        return torch.einsum("b h q k, b k h d -> b q h d", ps, v)

    def forward(self, x, x_kv=None):
        q, k, v = self.compute_qkv(x, x_kv)
        attn = self.compute_attention_heads(q, k, v)
        return attn.reshape(*attn.shape[:-2], -1)


class PerFeatureEncoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        d_k = config.emsize // config.nhead
        self.self_attn_between_features = MultiHeadAttention(d_k, d_k, config)
        self.layer_norm = nn.LayerNorm(config.emsize, eps=config.layer_norm_eps)
        self.mlp = nn.Sequential(nn.Linear(config.emsize, 128), nn.GELU(), nn.Linear(128, config.emsize))
        self.mlp_norm = nn.LayerNorm(config.emsize, eps=config.layer_norm_eps)

    def forward(self, x):
        h = self.layer_norm(x + self.self_attn_between_features(x))
        return self.mlp_norm(h + self.mlp(h))


def make_tabpfn_layer():
    torch.manual_seed(4908)
    model = PerFeatureEncoderLayer(ModelConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {   'target': 'make_tabpfn_layer',
    'kind': 'multihead',
    'ok': False,
    'layer': 'self_attn_between_features',
    'stage': 'output',
    'mistake': 'missing_out_proj',
    'style': 'TabPFN (Prior Labs) (b19_w_out_skipped): (base c08) one bug: forward returns the '
             'merged heads (attn.reshape(..., -1)) without the einsum with _w_out'}

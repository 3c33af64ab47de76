"""IDEA-Research GroundingDINO (groundingdino/models/GroundingDINO/fuse_modules.py, BiMultiHeadAttention
inside BiAttentionBlock), image side: queries from the image features (`v_proj`, multiplied by
`self.scale` right away), keys from the text features (`l_proj`), values from the text features
(`values_l_proj`), the `_shape` view/transpose and `proj_shape` (bsz*heads, -1, head_dim) folds,
`torch.bmm`, the `stable_softmax_2d` max subtraction and the +-50000 clamps, softmax, `torch.bmm` with the
values, `out_v_proj`; the block adds `gamma_v * delta_v` after LayerNorms on both inputs.

This file: correct (8 heads of 4, embed_dim 32 below the 64-wide image features, text 64 wide)."""

import torch
from torch import nn
import torch.nn.functional as F


class BiMultiHeadAttention(nn.Module):
    """Deviation: only the image-side update is computed (the text-side update is switched off)."""

    def __init__(self, v_dim, l_dim, embed_dim, num_heads):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.v_dim = v_dim
        self.l_dim = l_dim
        self.scale = self.head_dim ** (-0.5)
        self.v_proj = nn.Linear(self.v_dim, self.embed_dim)
        self.l_proj = nn.Linear(self.l_dim, self.embed_dim)
        self.values_v_proj = nn.Linear(self.v_dim, self.embed_dim)
        self.values_l_proj = nn.Linear(self.l_dim, self.embed_dim)
        self.out_v_proj = nn.Linear(self.embed_dim, self.v_dim)
        self.stable_softmax_2d = True
        self.clamp_min_for_underflow = True
        self.clamp_max_for_overflow = True

    def _shape(self, tensor, seq_len, bsz):
        return tensor.view(bsz, seq_len, self.num_heads, self.head_dim).transpose(1, 2).contiguous()

    def forward(self, v, l, attention_mask_l=None):
        bsz, tgt_len, _ = v.size()
        query_states = self.v_proj(v) * self.scale
        key_states = self._shape(self.l_proj(l), -1, bsz)
        value_l_states = self._shape(self.values_l_proj(l), -1, bsz)

        proj_shape = (bsz * self.num_heads, -1, self.head_dim)
        query_states = self._shape(query_states, tgt_len, bsz).view(*proj_shape)
        key_states = key_states.view(*proj_shape)
        value_l_states = value_l_states.view(*proj_shape)

        src_len = key_states.size(1)
        attn_weights = torch.bmm(query_states, key_states.transpose(1, 2))
        if self.stable_softmax_2d:
            attn_weights = attn_weights - attn_weights.max()
        if self.clamp_min_for_underflow:
            attn_weights = torch.clamp(attn_weights, min=-50000)
        if self.clamp_max_for_overflow:
            attn_weights = torch.clamp(attn_weights, max=50000)

        if attention_mask_l is not None:
            mask = attention_mask_l[:, None, None, :].repeat(1, self.num_heads, 1, 1).flatten(0, 1)
            attn_weights = attn_weights.masked_fill(mask == 0, float("-inf"))
        attn_weights_v = attn_weights.softmax(dim=-1)

        attn_output_v = torch.bmm(attn_weights_v, value_l_states)
        attn_output_v = attn_output_v.view(bsz, self.num_heads, tgt_len, self.head_dim)
        attn_output_v = attn_output_v.transpose(1, 2)
        attn_output_v = attn_output_v.reshape(bsz, tgt_len, self.embed_dim)
        attn_output_v = self.out_v_proj(attn_output_v)
        return attn_output_v


class BiAttentionBlock(nn.Module):
    def __init__(self, v_dim, l_dim, embed_dim, num_heads, init_values=1e-4):
        super().__init__()
        self.layer_norm_v = nn.LayerNorm(v_dim)
        self.layer_norm_l = nn.LayerNorm(l_dim)
        self.attn = BiMultiHeadAttention(v_dim, l_dim, embed_dim, num_heads)
        self.gamma_v = nn.Parameter(init_values * torch.ones(v_dim))

    def forward(self, v, l):
        v = self.layer_norm_v(v)
        l = self.layer_norm_l(l)
        delta_v = self.attn(v, l)
        return v + self.gamma_v * delta_v


def make_gdino_fusion():
    torch.manual_seed(2442)
    block = BiAttentionBlock(v_dim=64, l_dim=64, embed_dim=32, num_heads=8)
    with torch.no_grad():
        block.gamma_v.uniform_(0.5, 1.5)
        for mod in block.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
    return block.eval()


EXPECT = {'target': 'make_gdino_fusion',
 'kind': 'cross',
 'ok': True,
 'layer': 'attn',
 'structure': {'heads': 8,
               'kv_heads': 8,
               'head_dim': 4,
               'causal': False,
               'cross': True,
               'rope': None,
               'qk_norm': None,
               'window': None,
               'bias': None},
 'style': 'GroundingDINO BiMultiHeadAttention image side: correct (8x4, embed_dim 32, out_v_proj '
          'back to 64)'}

"""SpeechBrain transformer decoder (`speechbrain.lobes.models.transformer.TransformerDecoderLayer`,
normalize_before=True): the encoder-decoder half of the layer, `tgt1 = self.norm2(tgt)` then
`self.mutihead_attn(query=tgt1, key=memory, value=memory)` (SpeechBrain spells the attribute that
way), residual add. `speechbrain.nnet.attention.MultiheadAttention` wraps `nn.MultiheadAttention`
(batch_first=True) in `self.att` and returns `(output, attention)`. Cross-attention: target takes
(tgt, memory).

This file: one bug: mutihead_attn called with key=tgt1, value=tgt1 (copied from the self-attention call)."""

import torch
from torch import nn


class MultiheadAttention(nn.Module):
    def __init__(self, nhead, d_model, dropout=0.0, bias=True, add_bias_kv=False,
                 add_zero_attn=False, kdim=None, vdim=None):
        super().__init__()
        self.att = nn.MultiheadAttention(
            embed_dim=d_model,
            num_heads=nhead,
            dropout=dropout,
            bias=bias,
            add_bias_kv=add_bias_kv,
            add_zero_attn=add_zero_attn,
            kdim=kdim,
            vdim=vdim,
            batch_first=True,
        )

    def forward(self, query, key, value, attn_mask=None, key_padding_mask=None,
                return_attn_weights=True, pos_embs=None):
        if pos_embs is not None:
            query = query + pos_embs
            key = key + pos_embs
        output, attention = self.att(
            query, key, value, attn_mask=attn_mask, key_padding_mask=key_padding_mask,
            need_weights=return_attn_weights,
        )
        if return_attn_weights:
            return output, attention
        return output


class LayerNorm(nn.Module):
    def __init__(self, input_size, eps=1e-5):
        super().__init__()
        self.norm = nn.LayerNorm(input_size, eps=eps)

    def forward(self, x):
        return self.norm(x)


class DecoderCrossAttentionBlock(nn.Module):
    def __init__(self, nhead=8, d_model=64, kdim=None):
        super().__init__()
        self.mutihead_attn = MultiheadAttention(nhead=nhead, d_model=d_model, kdim=kdim, vdim=kdim)
        self.norm2 = LayerNorm(d_model, eps=1e-6)

    def forward(self, tgt, memory, memory_mask=None, memory_key_padding_mask=None):
        tgt1 = self.norm2(tgt)
        tgt2, multihead_attention = self.mutihead_attn(
            query=tgt1,
            key=tgt1,
            value=tgt1,
            attn_mask=memory_mask,
            key_padding_mask=memory_key_padding_mask,
        )
        return tgt + tgt2


def make_speechbrain_cross():
    torch.manual_seed(2226)
    model = DecoderCrossAttentionBlock()
    with torch.no_grad():
        model.norm2.norm.weight.uniform_(0.5, 1.5)
        model.norm2.norm.bias.uniform_(-0.2, 0.2)
        for name, p in model.mutihead_attn.att.named_parameters():
            if name.endswith("bias"):
                p.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {'target': 'make_speechbrain_cross',
 'kind': 'cross',
 'ok': False,
 'layer': 'mutihead_attn',
 'stage': 'keys',
 'mistake': 'wrong_source',
 'style': 'SpeechBrain TransformerDecoderLayer cross-attention (MultiheadAttention wrapping '
          'nn.MultiheadAttention): mutihead_attn called with key=tgt1, value=tgt1 (copied from the '
          'self-attention call)'}

"""MusicGen decoder layer (HF MusicgenDecoderLayer), self-attention sublayer.

MusicgenAttention in the BART family layout: bias-free q/k/v/out projections, queries
multiplied by `scaling` right after q_proj, heads folded into the batch for bmm, the
additive 4D causal mask (finfo.min) built by the decoder from the input shape. The
sinusoidal position embedding is added before the layer, so it is outside this check.
"""

import torch
from torch import nn


class MusicgenAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, dropout=0.0, is_decoder=True, bias=False):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim**-0.5
        self.is_decoder = is_decoder
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)

    def _shape(self, tensor, seq_len, bsz):
        return tensor.view(bsz, seq_len, self.num_heads, self.head_dim).transpose(1, 2).contiguous()

    def forward(self, hidden_states, key_value_states=None, attention_mask=None):
        is_cross_attention = key_value_states is not None
        bsz, tgt_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states) * self.scaling
        if is_cross_attention:
            key_states = self._shape(self.k_proj(key_value_states), -1, bsz)
            value_states = self._shape(self.v_proj(key_value_states), -1, bsz)
        else:
            key_states = self._shape(self.k_proj(hidden_states), -1, bsz)
            value_states = self._shape(self.v_proj(hidden_states), -1, bsz)

        proj_shape = (bsz * self.num_heads, -1, self.head_dim)
        query_states = self._shape(query_states, tgt_len, bsz).view(*proj_shape)
        key_states = key_states.reshape(*proj_shape)
        value_states = value_states.reshape(*proj_shape)

        src_len = key_states.size(1)
        attn_weights = torch.bmm(query_states, key_states.transpose(1, 2))
        if attention_mask is not None:
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len) + attention_mask
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_output = torch.bmm(attn_weights, value_states)
        attn_output = attn_output.view(bsz, self.num_heads, tgt_len, self.head_dim)
        attn_output = attn_output.transpose(1, 2)
        attn_output = attn_output.reshape(bsz, tgt_len, self.embed_dim)
        attn_output = self.out_proj(attn_output)
        return attn_output, None


class MusicgenDecoderLayer(nn.Module):
    def __init__(self, hidden_size=64, num_heads=4, ffn_dim=128):
        super().__init__()
        self.self_attn = MusicgenAttention(hidden_size, num_heads, is_decoder=True, bias=False)
        self.self_attn_layer_norm = nn.LayerNorm(hidden_size)
        self.fc1 = nn.Linear(hidden_size, ffn_dim, bias=False)
        self.fc2 = nn.Linear(ffn_dim, hidden_size, bias=False)
        self.final_layer_norm = nn.LayerNorm(hidden_size)

    def forward(self, hidden_states, attention_mask=None):
        residual = hidden_states
        hidden_states = self.self_attn_layer_norm(hidden_states)
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states, attention_mask=attention_mask
        )
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.final_layer_norm(hidden_states)
        hidden_states = self.fc2(nn.functional.gelu(self.fc1(hidden_states)))
        return residual + hidden_states


def _make_causal_mask(input_shape, dtype):
    bsz, tgt_len = input_shape
    mask = torch.full((tgt_len, tgt_len), torch.finfo(dtype).min, dtype=dtype)
    mask_cond = torch.arange(mask.size(-1))
    mask.masked_fill_(mask_cond < (mask_cond + 1).view(mask.size(-1), 1), 0)
    mask = mask.to(dtype)
    return mask[None, None, :, :].expand(bsz, 1, tgt_len, tgt_len)


class MusicgenDecoderOneLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([MusicgenDecoderLayer()])
        self.layer_norm = nn.LayerNorm(64)

    def forward(self, inputs_embeds, attention_mask=None):
        input_shape = inputs_embeds.shape[:2]
        causal_mask = _make_causal_mask(input_shape, inputs_embeds.dtype)
        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask=causal_mask)
        return self.layer_norm(hidden_states)


def make_musicgen_decoder():
    torch.manual_seed(108)
    dec = MusicgenDecoderOneLayer()
    with torch.no_grad():
        for mod in dec.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.1, 0.1)
    return dec.eval()


EXPECT = {
    "target": "make_musicgen_decoder",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "layers.0.self_attn",
    "structure": {
        "heads": 4,
        "kv_heads": 4,
        "head_dim": 16,
        "causal": True,
        "cross": False,
        "rope": None,
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "HF MusicGen decoder (MusicgenAttention BART-family layout: bias-free projections, q_proj * scaling, "
    "_shape + bmm over bsz*heads, _make_causal_mask finfo.min 4D mask built by the decoder)",
}

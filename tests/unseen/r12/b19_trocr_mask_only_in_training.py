"""Hugging Face TrOCR decoder self-attention in a one-layer TrOCR decoder body: learned positional
embeddings with the offset of 2 added to scaled inputs, layernorm_embedding, a causal 4D additive mask
built like _make_causal_mask (full of finfo(dtype).min, zeroed where mask_cond < (mask_cond + 1)),
TrOCRAttention (q_proj * scaling, (bsz * heads) fold, bmm, mask added on the (bsz, heads) view,
softmax, bmm, out_proj) and a post-norm self_attn_layer_norm.

This file's one bug: TrOCR decoder: the causal mask built only under self.training (guard copied
from a dropout branch), so in eval the decoder sees the future."""

import math

import torch
from torch import nn


class TrOCRAttention(nn.Module):
    def __init__(
        self,
        embed_dim,
        num_heads,
        kdim=None,
        vdim=None,
        dropout=0.0,
        is_decoder=False,
        bias=True,
        is_cross_attention=False,
    ):
        super().__init__()
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.head_dim = embed_dim // num_heads
        if not (self.head_dim * num_heads == self.embed_dim):
            raise ValueError("embed_dim must be divisible by num_heads")
        self.scaling = self.head_dim**-0.5
        self.is_decoder = is_decoder
        self.k_proj = nn.Linear(self.kdim, embed_dim, bias=bias)
        self.v_proj = nn.Linear(self.vdim, embed_dim, bias=bias)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)

    def _shape(self, tensor, seq_len, bsz):
        return tensor.view(bsz, seq_len, self.num_heads, self.head_dim).transpose(1, 2).contiguous()

    def forward(self, hidden_states, key_value_states=None, attention_mask=None):
        is_cross_attention = key_value_states is not None
        bsz, tgt_len, embed_dim = hidden_states.size()
        query_states = self.q_proj(hidden_states) * self.scaling
        if is_cross_attention:
            key_states = self._shape(self.k_proj(key_value_states), -1, bsz)
            value_states = self._shape(self.v_proj(key_value_states), -1, bsz)
        else:
            key_states = self._shape(self.k_proj(hidden_states), -1, bsz)
            value_states = self._shape(self.v_proj(hidden_states), -1, bsz)

        proj_shape = (bsz * self.num_heads, -1, self.head_dim)
        query_states = self._shape(query_states, tgt_len, bsz).view(*proj_shape)
        key_states = key_states.view(*proj_shape)
        value_states = value_states.view(*proj_shape)

        src_len = key_states.size(1)
        attn_weights = torch.bmm(query_states, key_states.transpose(1, 2))

        if attention_mask is not None:
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len) + attention_mask
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)

        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_probs = nn.functional.dropout(attn_weights, p=self.dropout, training=self.training)
        attn_output = torch.bmm(attn_probs, value_states)

        attn_output = attn_output.view(bsz, self.num_heads, tgt_len, self.head_dim)
        attn_output = attn_output.transpose(1, 2)
        attn_output = attn_output.reshape(bsz, tgt_len, embed_dim)
        attn_output = self.out_proj(attn_output)
        return attn_output, None


class TrOCRLearnedPositionalEmbedding(nn.Embedding):
    def __init__(self, num_embeddings, embedding_dim):
        self.offset = 2
        super().__init__(num_embeddings + self.offset, embedding_dim)

    def forward(self, input_shape, past_key_values_length=0):
        bsz, seq_len = input_shape[:2]
        positions = torch.arange(
            past_key_values_length,
            past_key_values_length + seq_len,
            dtype=torch.long,
            device=self.weight.device,
        ).expand(bsz, -1)
        return super().forward(positions + self.offset)


def make_causal_mask(input_shape, dtype, device):
    bsz, tgt_len = input_shape
    mask = torch.full((tgt_len, tgt_len), torch.finfo(dtype).min, device=device, dtype=dtype)
    mask_cond = torch.arange(mask.size(-1), device=device)
    mask.masked_fill_(mask_cond < (mask_cond + 1).view(mask.size(-1), 1), 0)
    mask = mask.to(dtype)
    return mask[None, None, :, :].expand(bsz, 1, tgt_len, tgt_len)


class TrOCRDecoderLayer(nn.Module):
    def __init__(self, d_model, heads):
        super().__init__()
        self.self_attn = TrOCRAttention(d_model, heads, is_decoder=True)
        self.self_attn_layer_norm = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, 2 * d_model)
        self.fc2 = nn.Linear(2 * d_model, d_model)
        self.final_layer_norm = nn.LayerNorm(d_model)

    def forward(self, hidden_states, attention_mask):
        residual = hidden_states
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states, attention_mask=attention_mask
        )
        hidden_states = self.self_attn_layer_norm(residual + hidden_states)
        residual = hidden_states
        hidden_states = self.fc2(torch.relu(self.fc1(hidden_states)))
        return self.final_layer_norm(residual + hidden_states)


class TrOCRDecoder(nn.Module):
    def __init__(self, d_model=64, heads=4, max_position_embeddings=128):
        super().__init__()
        self.embed_scale = math.sqrt(d_model)
        self.embed_positions = TrOCRLearnedPositionalEmbedding(max_position_embeddings, d_model)
        self.layernorm_embedding = nn.LayerNorm(d_model)
        self.layers = nn.ModuleList([TrOCRDecoderLayer(d_model, heads)])

    def forward(self, inputs_embeds):
        input_shape = inputs_embeds.shape[:-1]
        hidden_states = inputs_embeds * self.embed_scale
        hidden_states = hidden_states + self.embed_positions(input_shape).to(inputs_embeds.dtype)
        hidden_states = self.layernorm_embedding(hidden_states)
        attention_mask = (
            make_causal_mask(input_shape, hidden_states.dtype, hidden_states.device)
            if self.training
            else None
        )
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask)
        return hidden_states


def make_trocr_decoder():
    torch.manual_seed(1206)
    model = TrOCRDecoder()
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {
    "target": "make_trocr_decoder",
    "kind": "causal-multihead",
    "ok": False,
    "layer": "layers.0.self_attn",
    "stage": "masked_scores",
    "mistake": "missing_mask",
    "style": "TrOCR decoder: the causal mask built only under self.training (guard copied from a "
    "dropout branch), so in eval the decoder sees the future",
}

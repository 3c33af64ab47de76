"""Pegasus encoder-decoder, after transformers' modeling_pegasus.py.

PegasusForConditionalGeneration: model.shared, model.encoder (embed_positions = fixed sinusoidal
table, sin in the first half of each row and cos in the second, no offset; layers.N with
self_attn_layer_norm -> self_attn -> fc1/fc2 pre-norm; final layer_norm), model.decoder (the same
plus encoder_attn), lm_head tied to shared, final_logits_bias.  PegasusAttention: q_proj/k_proj/
v_proj/out_proj with bias, q_proj(h) * scaling, heads folded into (bsz * heads, len, hd) and bmm,
additive masks with finfo.min.  The token ids feed the encoder; shift_tokens_right(ids) (start token
0) feeds the decoder, so one call `model(ids)` runs encoder and decoder.  No padding mask is built
(HF builds none without attention_mask).  No cache.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

_ENC = ["model.encoder.layers.0.self_attn", "model.encoder.layers.1.self_attn"]
_DEC = [
    "model.decoder.layers.0.self_attn",
    "model.decoder.layers.0.encoder_attn",
    "model.decoder.layers.1.self_attn",
    "model.decoder.layers.1.encoder_attn",
]

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": _ENC + _DEC,
    "kind": "causal-multihead",
    "kinds": {
        _ENC[0]: "multihead",
        _ENC[1]: "multihead",
        _DEC[0]: "causal-multihead",
        _DEC[1]: "cross",
        _DEC[2]: "causal-multihead",
        _DEC[3]: "cross",
    },
    "cache": None,
    "structure": {
        "heads": 4,
        "kv_heads": 4,
        "head_dim": 20,
        "causal": True,
        "cross": False,
        "rope": None,
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "modeling_pegasus.py: sinusoidal embed_positions (sin | cos halves), embed_scale sqrt(d), pre-norm "
    "encoder/decoder with final layer_norm, PegasusAttention q_proj*scaling, (bsz*heads) bmm, tied lm_head + "
    "final_logits_bias, shift_tokens_right inside; d 80, 4 heads of 20",
}


def shift_tokens_right(input_ids, pad_token_id, decoder_start_token_id):
    shifted = input_ids.new_zeros(input_ids.shape)
    shifted[:, 1:] = input_ids[:, :-1].clone()
    shifted[:, 0] = decoder_start_token_id
    shifted.masked_fill_(shifted == -100, pad_token_id)
    return shifted


class PegasusSinusoidalPositionalEmbedding(nn.Embedding):
    def __init__(self, num_positions, embedding_dim):
        super().__init__(num_positions, embedding_dim)
        self.weight = self._init_weight(self.weight)

    @staticmethod
    def _init_weight(out):
        n_pos, dim = out.shape
        position_enc = torch.tensor(
            [[pos / (10000 ** (2 * (j // 2) / dim)) for j in range(dim)] for pos in range(n_pos)],
            dtype=torch.float64,
        )
        table = torch.empty(n_pos, dim, dtype=out.dtype)
        sentinel = dim // 2
        table[:, :sentinel] = torch.sin(position_enc[:, 0::2]).to(out.dtype)
        table[:, sentinel:] = torch.cos(position_enc[:, 1::2]).to(out.dtype)
        return nn.Parameter(table, requires_grad=False)

    @torch.no_grad()
    def forward(self, input_ids_shape, past_key_values_length=0):
        bsz, seq_len = input_ids_shape[:2]
        positions = torch.arange(
            past_key_values_length, past_key_values_length + seq_len, device=self.weight.device
        )
        return super().forward(positions)


class PegasusAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, is_decoder=False):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim**-0.5
        self.is_decoder = is_decoder
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def _shape(self, tensor, seq_len, bsz):
        return tensor.view(bsz, seq_len, self.num_heads, self.head_dim).transpose(1, 2).contiguous()

    def forward(self, hidden_states, key_value_states=None, attention_mask=None):
        is_cross_attention = key_value_states is not None
        bsz, tgt_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states) * self.scaling
        src = key_value_states if is_cross_attention else hidden_states
        key_states = self._shape(self.k_proj(src), -1, bsz)
        value_states = self._shape(self.v_proj(src), -1, bsz)
        proj_shape = (bsz * self.num_heads, -1, self.head_dim)
        query_states = self._shape(query_states, tgt_len, bsz).view(*proj_shape)
        key_states = key_states.reshape(*proj_shape)
        value_states = value_states.reshape(*proj_shape)
        src_len = key_states.size(1)
        attn_weights = torch.bmm(query_states, key_states.transpose(1, 2))
        if attention_mask is not None:
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len) + attention_mask
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_output = torch.bmm(attn_weights, value_states)
        attn_output = attn_output.view(bsz, self.num_heads, tgt_len, self.head_dim).transpose(1, 2)
        attn_output = attn_output.reshape(bsz, tgt_len, self.embed_dim)
        return self.out_proj(attn_output), None


class PegasusEncoderLayer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.self_attn = PegasusAttention(c.d_model, c.encoder_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(c.d_model)
        self.fc1 = nn.Linear(c.d_model, c.encoder_ffn_dim)
        self.fc2 = nn.Linear(c.encoder_ffn_dim, c.d_model)
        self.final_layer_norm = nn.LayerNorm(c.d_model)

    def forward(self, hidden_states, attention_mask):
        residual = hidden_states
        hidden_states = self.self_attn_layer_norm(hidden_states)
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states, attention_mask=attention_mask
        )
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.fc2(F.gelu(self.fc1(self.final_layer_norm(hidden_states))))
        return residual + hidden_states


class PegasusDecoderLayer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.self_attn = PegasusAttention(c.d_model, c.decoder_attention_heads, is_decoder=True)
        self.self_attn_layer_norm = nn.LayerNorm(c.d_model)
        self.encoder_attn = PegasusAttention(c.d_model, c.decoder_attention_heads, is_decoder=True)
        self.encoder_attn_layer_norm = nn.LayerNorm(c.d_model)
        self.fc1 = nn.Linear(c.d_model, c.decoder_ffn_dim)
        self.fc2 = nn.Linear(c.decoder_ffn_dim, c.d_model)
        self.final_layer_norm = nn.LayerNorm(c.d_model)

    def forward(self, hidden_states, attention_mask, encoder_hidden_states):
        residual = hidden_states
        hidden_states = self.self_attn_layer_norm(hidden_states)
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states, attention_mask=attention_mask
        )
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.encoder_attn_layer_norm(hidden_states)
        hidden_states, _ = self.encoder_attn(
            hidden_states=hidden_states, key_value_states=encoder_hidden_states
        )
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.fc2(F.gelu(self.fc1(self.final_layer_norm(hidden_states))))
        return residual + hidden_states


class PegasusEncoder(nn.Module):
    def __init__(self, c, embed_tokens):
        super().__init__()
        self.embed_scale = math.sqrt(c.d_model)
        self.embed_tokens = embed_tokens
        self.embed_positions = PegasusSinusoidalPositionalEmbedding(
            c.max_position_embeddings, c.d_model
        )
        self.layers = nn.ModuleList([PegasusEncoderLayer(c) for _ in range(c.encoder_layers)])
        self.layer_norm = nn.LayerNorm(c.d_model)

    def forward(self, input_ids):
        inputs_embeds = self.embed_tokens(input_ids) * self.embed_scale
        hidden_states = inputs_embeds + self.embed_positions(input_ids.shape)
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask=None)
        return self.layer_norm(hidden_states)


class PegasusDecoder(nn.Module):
    def __init__(self, c, embed_tokens):
        super().__init__()
        self.embed_scale = math.sqrt(c.d_model)
        self.embed_tokens = embed_tokens
        self.embed_positions = PegasusSinusoidalPositionalEmbedding(
            c.max_position_embeddings, c.d_model
        )
        self.layers = nn.ModuleList([PegasusDecoderLayer(c) for _ in range(c.decoder_layers)])
        self.layer_norm = nn.LayerNorm(c.d_model)

    def forward(self, input_ids, encoder_hidden_states):
        bsz, tgt_len = input_ids.shape
        inputs_embeds = self.embed_tokens(input_ids) * self.embed_scale
        dtype = inputs_embeds.dtype
        causal = torch.full(
            (tgt_len, tgt_len), torch.finfo(dtype).min, dtype=dtype, device=input_ids.device
        )
        causal = torch.triu(causal, diagonal=1)[None, None]
        hidden_states = inputs_embeds + self.embed_positions(input_ids.shape)
        for layer in self.layers:
            hidden_states = layer(hidden_states, causal, encoder_hidden_states)
        return self.layer_norm(hidden_states)


class PegasusModel(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.shared = nn.Embedding(c.vocab_size, c.d_model, padding_idx=c.pad_token_id)
        self.encoder = PegasusEncoder(c, self.shared)
        self.decoder = PegasusDecoder(c, self.shared)


class PegasusForConditionalGeneration(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.config = c
        self.model = PegasusModel(c)
        self.register_buffer("final_logits_bias", torch.zeros((1, c.vocab_size)))
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        self.lm_head.weight = self.model.shared.weight

    def forward(self, input_ids):
        c = self.config
        enc = self.model.encoder(input_ids)
        dec_ids = shift_tokens_right(input_ids, c.pad_token_id, c.decoder_start_token_id)
        dec = self.model.decoder(dec_ids, enc)
        return SimpleNamespace(
            logits=self.lm_head(dec) + self.final_logits_bias, encoder_last_hidden_state=enc
        )


def make_model():
    torch.manual_seed(802)
    c = SimpleNamespace(
        vocab_size=150,
        d_model=80,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=160,
        decoder_ffn_dim=160,
        max_position_embeddings=64,
        pad_token_id=0,
        decoder_start_token_id=0,
    )
    model = PegasusForConditionalGeneration(c)
    g = torch.Generator().manual_seed(8021)
    with torch.no_grad():
        model.final_logits_bias.copy_(0.1 * torch.randn(model.final_logits_bias.shape, generator=g))
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.25 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model.eval()

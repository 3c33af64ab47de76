"""M2M100 encoder-decoder, after transformers' modeling_m2m100.py.

M2M100ForConditionalGeneration: model.shared, model.encoder / model.decoder (embed_scale sqrt(d),
M2M100SinusoidalPositionalEmbedding with offset 2 and padding_idx 1: positions from the cumulative
count of non-pad tokens, sin half | cos half table; pre-norm layers; final layer_norm), lm_head tied
to shared.  M2M100Attention: q_proj/k_proj/v_proj/out_proj with bias, q_proj(h) * scaling,
(b, h, s, d) matmul, boolean keep-mask applied with masked_fill(~keep, finfo.min), softmax.  The
encoder sees the ids, the decoder shift_tokens_right(ids) with decoder_start_token_id 2; the ids the
checker sends (< 90) can contain the pad id 1, which (as in HF without an attention_mask) only
changes positions, never masks.  The attention class is chosen per layer from
`config.attn_class_per_layer` (as the attn_implementation plumbing does).
Slip: the decoder's layer 1 self-attention uses `M2M100WhereMaskAttention`, whose mask line is
`torch.where(keep, attn_weights, 0.0)`: future positions get score 0 instead of -inf, so they keep
a share of the softmax.  No cache.
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
    "ok": False,
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
    "layer": "model.decoder.layers.1.self_attn",
    "stage": "masked_scores",
    "mistake": "mask_fill_value",
    "style": "modeling_m2m100.py: offset-2 sinusoidal positions from non-pad cumsum, embed_scale, pre-norm, tied "
    "lm_head, per-layer attention classes; decoder layer 1's self-attention masks with torch.where(keep, w, 0.0) "
    "(fill 0 instead of finfo.min)",
}


def shift_tokens_right(input_ids, pad_token_id, decoder_start_token_id):
    shifted = input_ids.new_zeros(input_ids.shape)
    shifted[:, 1:] = input_ids[:, :-1].clone()
    shifted[:, 0] = decoder_start_token_id
    return shifted


def create_position_ids_from_input_ids(input_ids, padding_idx, past_key_values_length=0):
    mask = input_ids.ne(padding_idx).int()
    incremental_indices = (torch.cumsum(mask, dim=1).type_as(mask) + past_key_values_length) * mask
    return incremental_indices.long() + padding_idx


class M2M100SinusoidalPositionalEmbedding(nn.Module):
    def __init__(self, num_positions, embedding_dim, padding_idx):
        super().__init__()
        self.offset = 2
        self.padding_idx = padding_idx
        self.register_buffer(
            "weights",
            self.get_embedding(num_positions + self.offset, embedding_dim, padding_idx),
            persistent=False,
        )

    @staticmethod
    def get_embedding(num_embeddings, embedding_dim, padding_idx):
        half_dim = embedding_dim // 2
        emb = math.log(10000) / (half_dim - 1)
        emb = torch.exp(torch.arange(half_dim, dtype=torch.int64).float() * -emb)
        emb = torch.arange(num_embeddings, dtype=torch.int64).float().unsqueeze(1) * emb.unsqueeze(
            0
        )
        emb = torch.cat([torch.sin(emb), torch.cos(emb)], dim=1).view(num_embeddings, -1)
        emb[padding_idx, :] = 0
        return emb

    def forward(self, input_ids):
        position_ids = create_position_ids_from_input_ids(input_ids, self.padding_idx)
        bsz, seq_len = input_ids.size()
        return self.weights.index_select(0, position_ids.view(-1)).view(bsz, seq_len, -1)


class M2M100Attention(nn.Module):
    def __init__(self, embed_dim, num_heads):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim**-0.5
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def _apply_mask(self, attn_weights, keep):
        return attn_weights.masked_fill(~keep, torch.finfo(attn_weights.dtype).min)

    def forward(self, hidden_states, key_value_states=None, attention_mask=None):
        bsz, tgt_len, _ = hidden_states.shape
        src = hidden_states if key_value_states is None else key_value_states
        shape = (bsz, -1, self.num_heads, self.head_dim)
        query_states = (self.q_proj(hidden_states) * self.scaling).view(shape).transpose(1, 2)
        key_states = self.k_proj(src).view(shape).transpose(1, 2)
        value_states = self.v_proj(src).view(shape).transpose(1, 2)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3))
        if attention_mask is not None:
            attn_weights = self._apply_mask(attn_weights, attention_mask)
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_output = (
            torch.matmul(attn_weights, value_states)
            .transpose(1, 2)
            .reshape(bsz, tgt_len, self.embed_dim)
        )
        return self.out_proj(attn_output), None


class M2M100WhereMaskAttention(M2M100Attention):
    def _apply_mask(self, attn_weights, keep):
        return torch.where(keep, attn_weights, 0.0)


ATTN_CLASSES = {"eager": M2M100Attention, "where": M2M100WhereMaskAttention}


class M2M100EncoderLayer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.self_attn = M2M100Attention(c.d_model, c.encoder_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(c.d_model)
        self.fc1 = nn.Linear(c.d_model, c.encoder_ffn_dim)
        self.fc2 = nn.Linear(c.encoder_ffn_dim, c.d_model)
        self.final_layer_norm = nn.LayerNorm(c.d_model)

    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states, _ = self.self_attn(hidden_states=self.self_attn_layer_norm(hidden_states))
        hidden_states = residual + hidden_states
        return hidden_states + self.fc2(F.relu(self.fc1(self.final_layer_norm(hidden_states))))


class M2M100DecoderLayer(nn.Module):
    def __init__(self, c, layer_idx):
        super().__init__()
        self.self_attn = ATTN_CLASSES[c.attn_class_per_layer[layer_idx]](
            c.d_model, c.decoder_attention_heads
        )
        self.self_attn_layer_norm = nn.LayerNorm(c.d_model)
        self.encoder_attn = M2M100Attention(c.d_model, c.decoder_attention_heads)
        self.encoder_attn_layer_norm = nn.LayerNorm(c.d_model)
        self.fc1 = nn.Linear(c.d_model, c.decoder_ffn_dim)
        self.fc2 = nn.Linear(c.decoder_ffn_dim, c.d_model)
        self.final_layer_norm = nn.LayerNorm(c.d_model)

    def forward(self, hidden_states, causal_keep, encoder_hidden_states):
        residual = hidden_states
        hidden_states, _ = self.self_attn(
            hidden_states=self.self_attn_layer_norm(hidden_states), attention_mask=causal_keep
        )
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states, _ = self.encoder_attn(
            hidden_states=self.encoder_attn_layer_norm(hidden_states),
            key_value_states=encoder_hidden_states,
        )
        hidden_states = residual + hidden_states
        return hidden_states + self.fc2(F.relu(self.fc1(self.final_layer_norm(hidden_states))))


class M2M100Encoder(nn.Module):
    def __init__(self, c, embed_tokens):
        super().__init__()
        self.embed_scale = math.sqrt(c.d_model)
        self.embed_tokens = embed_tokens
        self.embed_positions = M2M100SinusoidalPositionalEmbedding(
            c.max_position_embeddings, c.d_model, c.pad_token_id
        )
        self.layers = nn.ModuleList([M2M100EncoderLayer(c) for _ in range(c.encoder_layers)])
        self.layer_norm = nn.LayerNorm(c.d_model)

    def forward(self, input_ids):
        h = self.embed_tokens(input_ids) * self.embed_scale
        h = h + self.embed_positions(input_ids).to(h.dtype)
        for layer in self.layers:
            h = layer(h)
        return self.layer_norm(h)


class M2M100Decoder(nn.Module):
    def __init__(self, c, embed_tokens):
        super().__init__()
        self.embed_scale = math.sqrt(c.d_model)
        self.embed_tokens = embed_tokens
        self.embed_positions = M2M100SinusoidalPositionalEmbedding(
            c.max_position_embeddings, c.d_model, c.pad_token_id
        )
        self.layers = nn.ModuleList([M2M100DecoderLayer(c, i) for i in range(c.decoder_layers)])
        self.layer_norm = nn.LayerNorm(c.d_model)

    def forward(self, input_ids, encoder_hidden_states):
        t = input_ids.shape[1]
        h = self.embed_tokens(input_ids) * self.embed_scale
        h = h + self.embed_positions(input_ids).to(h.dtype)
        keep = torch.ones(t, t, dtype=torch.bool, device=input_ids.device).tril()[None, None]
        for layer in self.layers:
            h = layer(h, keep, encoder_hidden_states)
        return self.layer_norm(h)


class M2M100Model(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.shared = nn.Embedding(c.vocab_size, c.d_model, padding_idx=c.pad_token_id)
        self.encoder = M2M100Encoder(c, self.shared)
        self.decoder = M2M100Decoder(c, self.shared)


class M2M100ForConditionalGeneration(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.config = c
        self.model = M2M100Model(c)
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        self.lm_head.weight = self.model.shared.weight

    def forward(self, input_ids):
        enc = self.model.encoder(input_ids)
        dec_ids = shift_tokens_right(
            input_ids, self.config.pad_token_id, self.config.decoder_start_token_id
        )
        dec = self.model.decoder(dec_ids, enc)
        return SimpleNamespace(logits=self.lm_head(dec), encoder_last_hidden_state=enc)


def make_model():
    torch.manual_seed(808)
    c = SimpleNamespace(
        vocab_size=128,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_position_embeddings=64,
        pad_token_id=1,
        decoder_start_token_id=2,
        attn_class_per_layer=["eager", "where"],
    )
    model = M2M100ForConditionalGeneration(c)
    g = torch.Generator().manual_seed(8081)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model.eval()

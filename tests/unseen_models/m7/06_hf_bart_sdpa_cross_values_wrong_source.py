"""BART (modeling_bart.py) encoder-decoder over the same token ids, decoder ids shifted inside.

BartAttention: q_proj/k_proj/v_proj/out_proj with bias, query * scaling, heads folded into the
batch (bsz * heads, len, hd) for bmm, additive finfo.min causal mask in the decoder, learned
positions with offset 2, layernorm_embedding, post-norm layers, tied lm_head + final_logits_bias.
Attention classes are chosen per layer (config.attn_implementation_per_layer, eager or sdpa).
Slip: the SDPA cross-attention class (decoder layer 1's encoder_attn) projects the values from
hidden_states (the decoder stream) instead of key_value_states.  No cache.
"""

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": [
        "model.encoder.layers.0.self_attn",
        "model.encoder.layers.1.self_attn",
        "model.decoder.layers.0.self_attn",
        "model.decoder.layers.0.encoder_attn",
        "model.decoder.layers.1.self_attn",
        "model.decoder.layers.1.encoder_attn",
    ],
    "kind": "causal-multihead",
    "kinds": {
        "model.encoder.layers.0.self_attn": "multihead",
        "model.encoder.layers.1.self_attn": "multihead",
        "model.decoder.layers.0.self_attn": "causal-multihead",
        "model.decoder.layers.0.encoder_attn": "cross",
        "model.decoder.layers.1.self_attn": "causal-multihead",
        "model.decoder.layers.1.encoder_attn": "cross",
    },
    "cache": None,
    "layer": "model.decoder.layers.1.encoder_attn",
    "stage": "values",
    "mistake": "wrong_source",
    "style": "modeling_bart.py: BartAttention q*scaling, (bsz*heads) bmm, offset-2 learned positions, layernorm_embedding, "
    "post-norm, shift_tokens_right inside; slip: per-layer SDPA cross-attention class takes v_proj(hidden_states)",
}


class BartConfig:
    vocab_size = 130
    d_model = 64
    encoder_layers = 2
    decoder_layers = 2
    encoder_attention_heads = 4
    decoder_attention_heads = 4
    encoder_ffn_dim = 128
    decoder_ffn_dim = 128
    max_position_embeddings = 64
    pad_token_id = 1
    decoder_start_token_id = 2
    # per decoder layer: class used for (self_attn, encoder_attn)
    attn_implementation_per_layer = [("eager", "eager"), ("eager", "sdpa")]


def shift_tokens_right(input_ids, pad_token_id, decoder_start_token_id):
    shifted = input_ids.new_zeros(input_ids.shape)
    shifted[:, 1:] = input_ids[:, :-1].clone()
    shifted[:, 0] = decoder_start_token_id
    shifted.masked_fill_(shifted == -100, pad_token_id)
    return shifted


class BartLearnedPositionalEmbedding(nn.Embedding):
    def __init__(self, num_embeddings, embedding_dim):
        self.offset = 2
        super().__init__(num_embeddings + self.offset, embedding_dim)

    def forward(self, input_ids, past_key_values_length=0):
        bsz, seq_len = input_ids.shape[:2]
        positions = torch.arange(
            past_key_values_length,
            past_key_values_length + seq_len,
            dtype=torch.long,
            device=self.weight.device,
        ).expand(bsz, -1)
        return super().forward(positions + self.offset)


class BartAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, is_decoder=False, is_causal=False):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim**-0.5
        self.is_decoder = is_decoder
        self.is_causal = is_causal
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
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_output = torch.bmm(attn_weights, value_states)
        attn_output = attn_output.view(bsz, self.num_heads, tgt_len, self.head_dim).transpose(1, 2)
        attn_output = attn_output.reshape(bsz, tgt_len, self.embed_dim)
        return self.out_proj(attn_output), None


class BartSdpaAttention(BartAttention):
    def forward(self, hidden_states, key_value_states=None, attention_mask=None):
        is_cross_attention = key_value_states is not None
        bsz, tgt_len, _ = hidden_states.size()
        query_states = self._shape(self.q_proj(hidden_states), tgt_len, bsz)
        if is_cross_attention:
            key_states = self._shape(self.k_proj(key_value_states), -1, bsz)
            value_states = self._shape(self.v_proj(hidden_states), -1, bsz)
        else:
            key_states = self._shape(self.k_proj(hidden_states), -1, bsz)
            value_states = self._shape(self.v_proj(hidden_states), -1, bsz)
        attn_output = F.scaled_dot_product_attention(
            query_states, key_states, value_states, attn_mask=attention_mask, scale=self.scaling
        )
        attn_output = attn_output.transpose(1, 2).reshape(bsz, tgt_len, self.embed_dim)
        return self.out_proj(attn_output), None


ATTN_CLASSES = {"eager": BartAttention, "sdpa": BartSdpaAttention}


class BartEncoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = BartAttention(config.d_model, config.encoder_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(config.d_model)
        self.fc1 = nn.Linear(config.d_model, config.encoder_ffn_dim)
        self.fc2 = nn.Linear(config.encoder_ffn_dim, config.d_model)
        self.final_layer_norm = nn.LayerNorm(config.d_model)

    def forward(self, hidden_states, attention_mask=None):
        residual = hidden_states
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states, attention_mask=attention_mask
        )
        hidden_states = self.self_attn_layer_norm(residual + hidden_states)
        residual = hidden_states
        hidden_states = self.fc2(F.gelu(self.fc1(hidden_states)))
        return self.final_layer_norm(residual + hidden_states)


class BartDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self_impl, cross_impl = config.attn_implementation_per_layer[layer_idx]
        self.self_attn = ATTN_CLASSES[self_impl](
            config.d_model, config.decoder_attention_heads, is_decoder=True, is_causal=True
        )
        self.self_attn_layer_norm = nn.LayerNorm(config.d_model)
        self.encoder_attn = ATTN_CLASSES[cross_impl](
            config.d_model, config.decoder_attention_heads, is_decoder=True
        )
        self.encoder_attn_layer_norm = nn.LayerNorm(config.d_model)
        self.fc1 = nn.Linear(config.d_model, config.decoder_ffn_dim)
        self.fc2 = nn.Linear(config.decoder_ffn_dim, config.d_model)
        self.final_layer_norm = nn.LayerNorm(config.d_model)

    def forward(self, hidden_states, attention_mask, encoder_hidden_states):
        residual = hidden_states
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states, attention_mask=attention_mask
        )
        hidden_states = self.self_attn_layer_norm(residual + hidden_states)
        residual = hidden_states
        hidden_states, _ = self.encoder_attn(
            hidden_states=hidden_states, key_value_states=encoder_hidden_states
        )
        hidden_states = self.encoder_attn_layer_norm(residual + hidden_states)
        residual = hidden_states
        hidden_states = self.fc2(F.gelu(self.fc1(hidden_states)))
        return self.final_layer_norm(residual + hidden_states)


class BartEncoder(nn.Module):
    def __init__(self, config, embed_tokens):
        super().__init__()
        self.embed_tokens = embed_tokens
        self.embed_positions = BartLearnedPositionalEmbedding(
            config.max_position_embeddings, config.d_model
        )
        self.layers = nn.ModuleList(
            [BartEncoderLayer(config) for _ in range(config.encoder_layers)]
        )
        self.layernorm_embedding = nn.LayerNorm(config.d_model)

    def forward(self, input_ids):
        hidden_states = self.embed_tokens(input_ids) + self.embed_positions(input_ids)
        hidden_states = self.layernorm_embedding(hidden_states)
        for layer in self.layers:
            hidden_states = layer(hidden_states, None)
        return hidden_states


class BartDecoder(nn.Module):
    def __init__(self, config, embed_tokens):
        super().__init__()
        self.embed_tokens = embed_tokens
        self.embed_positions = BartLearnedPositionalEmbedding(
            config.max_position_embeddings, config.d_model
        )
        self.layers = nn.ModuleList(
            [BartDecoderLayer(config, i) for i in range(config.decoder_layers)]
        )
        self.layernorm_embedding = nn.LayerNorm(config.d_model)

    def forward(self, input_ids, encoder_hidden_states):
        bsz, tgt_len = input_ids.shape
        hidden_states = self.embed_tokens(input_ids) + self.embed_positions(input_ids)
        hidden_states = self.layernorm_embedding(hidden_states)
        dtype = hidden_states.dtype
        causal = torch.full(
            (tgt_len, tgt_len), torch.finfo(dtype).min, device=input_ids.device, dtype=dtype
        ).triu(1)
        causal_mask = causal[None, None].expand(bsz, 1, tgt_len, tgt_len)
        for layer in self.layers:
            hidden_states = layer(hidden_states, causal_mask, encoder_hidden_states)
        return hidden_states


class BartModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.shared = nn.Embedding(config.vocab_size, config.d_model, config.pad_token_id)
        self.encoder = BartEncoder(config, self.shared)
        self.decoder = BartDecoder(config, self.shared)

    def forward(self, input_ids):
        decoder_input_ids = shift_tokens_right(
            input_ids, self.config.pad_token_id, self.config.decoder_start_token_id
        )
        encoder_outputs = self.encoder(input_ids)
        return self.decoder(decoder_input_ids, encoder_outputs)


@dataclass
class Seq2SeqLMOutput:
    logits: torch.Tensor


class BartForConditionalGeneration(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = BartModel(config)
        self.register_buffer("final_logits_bias", torch.zeros((1, config.vocab_size)))
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.lm_head.weight = self.model.shared.weight

    def forward(self, input_ids):
        return Seq2SeqLMOutput(logits=self.lm_head(self.model(input_ids)) + self.final_logits_bias)


def make_model():
    torch.manual_seed(706)
    model = BartForConditionalGeneration(BartConfig())
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, nn.Linear):
                m.weight.normal_(0.0, 0.08)
                if m.bias is not None:
                    m.bias.normal_(0.0, 0.05)
            elif isinstance(m, nn.Embedding):
                m.weight.normal_(0.0, 0.5)
            elif isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn_like(m.weight))
                m.bias.copy_(0.1 * torch.randn_like(m.bias))
        model.final_logits_bias.normal_(0.0, 0.1)
    return model.eval()

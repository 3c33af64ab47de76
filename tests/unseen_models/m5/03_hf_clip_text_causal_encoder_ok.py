"""The text tower of CLIP in the shape of transformers' modeling_clip.py (written from memory, in my
own words): CLIPTextEmbeddings (token_embedding + learned position_embedding indexed by a
`position_ids` buffer), a CLIPEncoder whose layers are pre-LayerNorm (layer_norm1 / layer_norm2, with
biases), CLIPAttention with k_proj/v_proj/q_proj/out_proj (biases), queries multiplied by `scale`
after the projection, and a *causal* mask built by the text transformer and passed to every layer
as an additive `causal_attention_mask` (finfo.min above the diagonal) next to an optional padding
`attention_mask`.  quick_gelu MLP (fc1/fc2), final_layer_norm.  4 heads of 16, 3 layers.

Returns the last hidden state (batch, tokens, 64) as a tensor.  It is an encoder with a causal mask
(no cache, no logits).

Correct.
"""

import torch
import torch.nn as nn

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": [
        "text_model.encoder.layers.0.self_attn",
        "text_model.encoder.layers.1.self_attn",
        "text_model.encoder.layers.2.self_attn",
    ],
    "kind": "causal-multihead",
    "cache": None,
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
    "style": "modeling_clip.py text tower: learned positions via position_ids buffer, pre-LN with biases, "
    "q*scale after q_proj, additive causal_attention_mask argument, quick_gelu, returns hidden states",
}


class CLIPTextConfig:
    vocab_size = 180
    hidden_size = 64
    intermediate_size = 160
    num_hidden_layers = 3
    num_attention_heads = 4
    max_position_embeddings = 48
    layer_norm_eps = 1e-5


class CLIPTextEmbeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.token_embedding = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embedding = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.register_buffer(
            "position_ids",
            torch.arange(config.max_position_embeddings).expand((1, -1)),
            persistent=False,
        )

    def forward(self, input_ids):
        seq_length = input_ids.shape[-1]
        position_ids = self.position_ids[:, :seq_length]
        return self.token_embedding(input_ids) + self.position_embedding(position_ids)


class CLIPAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_dim = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.embed_dim // self.num_heads
        self.scale = self.head_dim**-0.5
        self.k_proj = nn.Linear(self.embed_dim, self.embed_dim)
        self.v_proj = nn.Linear(self.embed_dim, self.embed_dim)
        self.q_proj = nn.Linear(self.embed_dim, self.embed_dim)
        self.out_proj = nn.Linear(self.embed_dim, self.embed_dim)

    def _shape(self, tensor, seq_len, bsz):
        return tensor.view(bsz, seq_len, self.num_heads, self.head_dim).transpose(1, 2).contiguous()

    def forward(self, hidden_states, attention_mask=None, causal_attention_mask=None):
        bsz, tgt_len, embed_dim = hidden_states.size()
        query_states = self.q_proj(hidden_states) * self.scale
        key_states = self._shape(self.k_proj(hidden_states), -1, bsz)
        value_states = self._shape(self.v_proj(hidden_states), -1, bsz)
        proj_shape = (bsz * self.num_heads, -1, self.head_dim)
        query_states = self._shape(query_states, tgt_len, bsz).view(*proj_shape)
        key_states = key_states.view(*proj_shape)
        value_states = value_states.view(*proj_shape)
        src_len = key_states.size(1)
        attn_weights = torch.bmm(query_states, key_states.transpose(1, 2))
        if causal_attention_mask is not None:
            attn_weights = (
                attn_weights.view(bsz, self.num_heads, tgt_len, src_len) + causal_attention_mask
            )
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)
        if attention_mask is not None:
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len) + attention_mask
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_output = torch.bmm(attn_weights, value_states)
        attn_output = attn_output.view(bsz, self.num_heads, tgt_len, self.head_dim).transpose(1, 2)
        attn_output = attn_output.reshape(bsz, tgt_len, embed_dim)
        return self.out_proj(attn_output), None


class CLIPMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, hidden_states):
        h = self.fc1(hidden_states)
        return self.fc2(h * torch.sigmoid(1.702 * h))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = CLIPAttention(config)
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = CLIPMLP(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states, attention_mask, causal_attention_mask):
        residual = hidden_states
        hidden_states = self.layer_norm1(hidden_states)
        hidden_states, _ = self.self_attn(hidden_states, attention_mask, causal_attention_mask)
        hidden_states = residual + hidden_states
        residual = hidden_states
        return residual + self.mlp(self.layer_norm2(hidden_states))


class CLIPEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList(
            [CLIPEncoderLayer(config) for _ in range(config.num_hidden_layers)]
        )

    def forward(self, inputs_embeds, attention_mask=None, causal_attention_mask=None):
        hidden_states = inputs_embeds
        for encoder_layer in self.layers:
            hidden_states = encoder_layer(hidden_states, attention_mask, causal_attention_mask)
        return hidden_states


def _create_4d_causal_attention_mask(bsz, tgt_len, dtype):
    mask = torch.full((tgt_len, tgt_len), torch.finfo(dtype).min, dtype=dtype)
    mask = torch.triu(mask, diagonal=1)
    return mask[None, None, :, :].expand(bsz, 1, tgt_len, tgt_len)


class CLIPTextTransformer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embeddings = CLIPTextEmbeddings(config)
        self.encoder = CLIPEncoder(config)
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids, attention_mask=None):
        hidden_states = self.embeddings(input_ids)
        bsz, seq_len = input_ids.shape
        causal_attention_mask = _create_4d_causal_attention_mask(bsz, seq_len, hidden_states.dtype)
        if attention_mask is not None:
            inverted = 1.0 - attention_mask[:, None, None, :].to(hidden_states.dtype)
            attention_mask = inverted.masked_fill(
                inverted.bool(), torch.finfo(hidden_states.dtype).min
            )
        hidden_states = self.encoder(hidden_states, attention_mask, causal_attention_mask)
        return self.final_layer_norm(hidden_states)


class CLIPTextModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.text_model = CLIPTextTransformer(config)

    def forward(self, input_ids, attention_mask=None):
        return self.text_model(input_ids, attention_mask)


def make_model():
    torch.manual_seed(5303)
    model = CLIPTextModel(CLIPTextConfig())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn_like(m.weight))
                m.bias.copy_(0.1 * torch.randn_like(m.bias))
    return model.eval()

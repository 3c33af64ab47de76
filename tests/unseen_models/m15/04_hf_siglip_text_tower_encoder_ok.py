"""SigLIP's text tower, after transformers' modeling_siglip.py (SiglipTextModel).

SiglipTextModel -> text_model (SiglipTextTransformer): embeddings (token_embedding, learned
position_embedding read through a `position_ids` buffer), encoder (SiglipEncoder: layers.N =
SiglipEncoderLayer: layer_norm1 -> self_attn -> + residual, layer_norm2 -> mlp (fc1, gelu-tanh, fc2)
-> + residual), final_layer_norm, and `head` (pooled output from the last token).  SiglipAttention:
q_proj/k_proj/v_proj/out_proj with bias, scale head_dim ** -0.5, eager matmul, optional additive
padding mask, softmax in float32 for float32 inputs.  The text tower is bidirectional (not causal);
4 heads of 16.  Returns the last hidden state (b, t, 64); the pooled output is `model.pooled`.
No cache.  Correct everywhere.
"""

from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": [
        "text_model.encoder.layers.0.self_attn",
        "text_model.encoder.layers.1.self_attn",
        "text_model.encoder.layers.2.self_attn",
    ],
    "kind": "multihead",
    "cache": None,
    "style": "modeling_siglip.py SiglipTextModel: bidirectional encoder, learned positions via position_ids "
    "buffer, pre-LN with bias, q/k/v/out_proj with bias, scale head_dim**-0.5, gelu-tanh MLP, last-token head",
}


class SiglipTextEmbeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.token_embedding = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embedding = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.register_buffer(
            "position_ids", torch.arange(config.max_position_embeddings).expand((1, -1)), persistent=False
        )

    def forward(self, input_ids):
        seq_length = input_ids.shape[-1]
        position_ids = self.position_ids[:, :seq_length]
        return self.token_embedding(input_ids) + self.position_embedding(position_ids)


class SiglipAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_dim = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.embed_dim // self.num_heads
        self.scale = self.head_dim ** -0.5
        self.k_proj = nn.Linear(self.embed_dim, self.embed_dim)
        self.v_proj = nn.Linear(self.embed_dim, self.embed_dim)
        self.q_proj = nn.Linear(self.embed_dim, self.embed_dim)
        self.out_proj = nn.Linear(self.embed_dim, self.embed_dim)

    def forward(self, hidden_states, attention_mask=None):
        batch_size, seq_length, embed_dim = hidden_states.shape
        queries = self.q_proj(hidden_states)
        keys = self.k_proj(hidden_states)
        values = self.v_proj(hidden_states)
        queries = queries.view(batch_size, seq_length, self.num_heads, self.head_dim).transpose(1, 2)
        keys = keys.view(batch_size, seq_length, self.num_heads, self.head_dim).transpose(1, 2)
        values = values.view(batch_size, seq_length, self.num_heads, self.head_dim).transpose(1, 2)
        attn_weights = torch.matmul(queries, keys.transpose(2, 3)) * self.scale
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        softmax_dtype = torch.promote_types(queries.dtype, torch.float32)
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=softmax_dtype).to(queries.dtype)
        attn_output = torch.matmul(attn_weights, values)
        attn_output = attn_output.transpose(1, 2).reshape(batch_size, seq_length, embed_dim).contiguous()
        return self.out_proj(attn_output), attn_weights


class SiglipMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class SiglipEncoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = SiglipAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = SiglipMLP(config)

    def forward(self, hidden_states, attention_mask=None):
        residual = hidden_states
        hidden_states, _ = self.self_attn(self.layer_norm1(hidden_states), attention_mask=attention_mask)
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.layer_norm2(hidden_states))


class SiglipEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList([SiglipEncoderLayer(config) for _ in range(config.num_hidden_layers)])

    def forward(self, hidden_states, attention_mask=None):
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask)
        return hidden_states


class SiglipTextTransformer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embeddings = SiglipTextEmbeddings(config)
        self.encoder = SiglipEncoder(config)
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.head = nn.Linear(config.hidden_size, config.projection_size)

    def forward(self, input_ids, attention_mask=None):
        hidden_states = self.embeddings(input_ids)
        ext = None
        if attention_mask is not None:
            ext = (1.0 - attention_mask[:, None, None, :].to(hidden_states.dtype)) * torch.finfo(hidden_states.dtype).min
        last_hidden_state = self.final_layer_norm(self.encoder(hidden_states, ext))
        pooled_output = self.head(last_hidden_state[:, -1, :])
        return last_hidden_state, pooled_output


class SiglipTextModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.text_model = SiglipTextTransformer(config)
        self.pooled = None

    def forward(self, input_ids, attention_mask=None):
        last_hidden_state, pooled = self.text_model(input_ids, attention_mask)
        self.pooled = pooled
        return last_hidden_state


def make_model():
    torch.manual_seed(1504)
    config = SimpleNamespace(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, max_position_embeddings=64, layer_norm_eps=1e-6, projection_size=64,
    )
    model = SiglipTextModel(config)
    g = torch.Generator().manual_seed(15041)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model.eval()

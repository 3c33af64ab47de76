"""A tiny XGLM in the style of modeling_xglm.py (fairseq lineage, no cache).

XGLMForCausalLM -> model (embed_tokens scaled by sqrt(d_model), sinusoidal embed_positions with
offset 2 and padding_idx 1, layers ModuleList, layer_norm) + tied lm_head.  Pre-norm layers
(self_attn_layer_norm, fc1/fc2 with GELU, final_layer_norm).  XGLMAttention: k/v/q/out_proj with
bias, query scaled by head_dim ** -0.5 after its projection, fairseq (bsz * heads, len, head_dim)
bmm layout, additive finfo.min causal mask.  config.einsum_attention_layers = (2,) selects an
einsum implementation of the same attention for the last layer.

Slip: the einsum for the weighted sum is written "bhqk,bhqd->bhqd" instead of "bhqk,bhkd->bhqd":
the weights are summed out (they sum to 1) and each query gets its own token's value.
model.layers.2.self_attn, context, context_wrong_product.  Layers 0 and 1 are correct.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["model.layers.0.self_attn", "model.layers.1.self_attn", "model.layers.2.self_attn"],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "model.layers.2.self_attn",
    "stage": "context",
    "mistake": "context_wrong_product",
    "style": "transformers modeling_xglm.py: sinusoidal positions offset 2, scaled embeddings, fairseq bmm "
    "attention; slip: the einsum layer's weighted sum uses 'bhqk,bhqd->bhqd'",
}


@dataclass
class XGLMConfig:
    vocab_size: int = 168
    d_model: int = 48
    ffn_dim: int = 96
    num_layers: int = 3
    attention_heads: int = 4
    max_position_embeddings: int = 64
    pad_token_id: int = 1
    einsum_attention_layers: tuple = (2,)


class XGLMSinusoidalPositionalEmbedding(nn.Module):
    def __init__(self, num_positions, embedding_dim, padding_idx):
        super().__init__()
        self.offset = 2
        self.embedding_dim = embedding_dim
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

    def forward(self, position_ids):
        bsz, seq_len = position_ids.size()
        position_ids = position_ids + self.offset
        return self.weights.index_select(0, position_ids.view(-1)).view(
            bsz, seq_len, self.embedding_dim
        )


class XGLMAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, use_einsum=False):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim**-0.5
        self.use_einsum = use_einsum
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def _shape(self, tensor, seq_len, bsz):
        return tensor.view(bsz, seq_len, self.num_heads, self.head_dim).transpose(1, 2).contiguous()

    def forward(self, hidden_states, attention_mask):
        bsz, tgt_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states) * self.scaling
        key_states = self._shape(self.k_proj(hidden_states), -1, bsz)
        value_states = self._shape(self.v_proj(hidden_states), -1, bsz)
        query_states = self._shape(query_states, tgt_len, bsz)
        if self.use_einsum:
            attn_weights = (
                torch.einsum("bhqd,bhkd->bhqk", query_states, key_states) + attention_mask
            )
            attn_probs = attn_weights.softmax(dim=-1)
            attn_output = torch.einsum("bhqk,bhqd->bhqd", attn_probs, value_states)  # SLIP
        else:
            proj_shape = (bsz * self.num_heads, -1, self.head_dim)
            q = query_states.view(*proj_shape)
            k = key_states.view(*proj_shape)
            v = value_states.view(*proj_shape)
            src_len = k.size(1)
            attn_weights = (
                torch.bmm(q, k.transpose(1, 2)).view(bsz, self.num_heads, tgt_len, src_len)
                + attention_mask
            )
            attn_weights = torch.max(
                attn_weights,
                torch.tensor(torch.finfo(attn_weights.dtype).min, dtype=attn_weights.dtype),
            )
            attn_probs = F.softmax(
                attn_weights.view(bsz * self.num_heads, tgt_len, src_len), dim=-1
            )
            attn_output = torch.bmm(attn_probs, v).view(bsz, self.num_heads, tgt_len, self.head_dim)
        attn_output = attn_output.transpose(1, 2).reshape(bsz, tgt_len, self.embed_dim)
        return self.out_proj(attn_output)


class XGLMDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = XGLMAttention(
            config.d_model,
            config.attention_heads,
            use_einsum=layer_idx in config.einsum_attention_layers,
        )
        self.self_attn_layer_norm = nn.LayerNorm(config.d_model)
        self.fc1 = nn.Linear(config.d_model, config.ffn_dim)
        self.fc2 = nn.Linear(config.ffn_dim, config.d_model)
        self.final_layer_norm = nn.LayerNorm(config.d_model)

    def forward(self, hidden_states, attention_mask):
        hidden_states = hidden_states + self.self_attn(
            self.self_attn_layer_norm(hidden_states), attention_mask
        )
        return hidden_states + self.fc2(F.gelu(self.fc1(self.final_layer_norm(hidden_states))))


class XGLMModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_scale = math.sqrt(config.d_model)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model, config.pad_token_id)
        self.embed_positions = XGLMSinusoidalPositionalEmbedding(
            config.max_position_embeddings, config.d_model, config.pad_token_id
        )
        self.layers = nn.ModuleList([XGLMDecoderLayer(config, i) for i in range(config.num_layers)])
        self.layer_norm = nn.LayerNorm(config.d_model)

    def forward(self, input_ids):
        bsz, seq_len = input_ids.shape
        inputs_embeds = self.embed_tokens(input_ids) * self.embed_scale
        position_ids = torch.arange(seq_len, device=input_ids.device).unsqueeze(0).expand(bsz, -1)
        hidden_states = inputs_embeds + self.embed_positions(position_ids).to(inputs_embeds.dtype)
        min_val = torch.finfo(hidden_states.dtype).min
        mask = torch.triu(
            torch.full((seq_len, seq_len), min_val, dtype=hidden_states.dtype), diagonal=1
        )[None, None]
        for layer in self.layers:
            hidden_states = layer(hidden_states, mask)
        return self.layer_norm(hidden_states)


class XGLMForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = XGLMModel(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids):
        return self.lm_head(self.model(input_ids))


def make_model():
    torch.manual_seed(9)
    model = XGLMForCausalLM(XGLMConfig())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.25 * torch.randn_like(m.weight))
                m.bias.copy_(0.05 * torch.randn_like(m.bias))
    return model.eval()

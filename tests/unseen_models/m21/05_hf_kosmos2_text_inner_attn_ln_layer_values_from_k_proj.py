"""Kosmos-2's text decoder used as a causal LM, after transformers' modeling_kosmos2.py.

Kosmos2TextForCausalLM: model (Kosmos2TextTransformer: embed_scale sqrt(d), embed_tokens,
embed_positions = Kosmos2TextSinusoidalPositionalEmbedding (fairseq sin|cos halves, padding_idx 1,
positions from the non-pad cumsum + padding_idx), layers.N, layer_norm) and lm_head.
Kosmos2TextBlock (pre-norm): self_attn_layer_norm -> self_attn -> + residual, final_layer_norm -> ffn
(fc1, gelu, ffn_layernorm, fc2) -> + residual; the image cross-attention is not built.
KosmosTextAttention: q_proj/k_proj/v_proj/out_proj with bias, q_proj(h) * scaling, (b, h, t, d)
matmul, additive finfo.min causal mask, softmax, and Magneto's `inner_attn_ln` (LayerNorm over the
merged heads) before out_proj.
Slip: the config lists `kv_shared_layers = [1]` (a leftover of a key/value-sharing ablation), and
layer 1's attention, built with `share_kv=True`, projects its values with k_proj; its v_proj is unused.
No cache.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": [
        "model.layers.0.self_attn",
        "model.layers.1.self_attn",
        "model.layers.2.self_attn",
    ],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "model.layers.1.self_attn",
    "stage": "values",
    "mistake": "wrong_projection",
    "style": "modeling_kosmos2.py text decoder: embed_scale, offset sinusoidal positions from non-pad cumsum, "
    "pre-norm blocks with ffn_layernorm, q_proj*scaling, inner_attn_ln before out_proj; layer 1 takes values from k_proj",
}


class Kosmos2TextSinusoidalPositionalEmbedding(nn.Module):
    def __init__(self, num_positions, embedding_dim, padding_idx):
        super().__init__()
        self.offset = 2
        self.embedding_dim = embedding_dim
        self.padding_idx = padding_idx
        self.num_positions = num_positions + self.offset

    def get_embedding(self, num_embeddings, embedding_dim, padding_idx):
        half_dim = embedding_dim // 2
        emb = math.log(10000) / (half_dim - 1)
        emb = torch.exp(torch.arange(half_dim, dtype=torch.float64) * -emb)
        emb = torch.arange(num_embeddings, dtype=torch.float64).unsqueeze(1) * emb.unsqueeze(0)
        emb = torch.cat([torch.sin(emb), torch.cos(emb)], dim=1).view(num_embeddings, -1)
        emb[padding_idx, :] = 0
        return emb

    def forward(self, input_ids, past_key_values_length=0, dtype=torch.float32):
        mask = input_ids.ne(self.padding_idx).int()
        incremental_indices = (torch.cumsum(mask, dim=1).type_as(mask) + past_key_values_length) * mask
        position_ids = incremental_indices.long() + self.padding_idx
        weights = self.get_embedding(self.num_positions, self.embedding_dim, self.padding_idx)
        bsz, seq_len = input_ids.shape
        return weights.index_select(0, position_ids.view(-1)).view(bsz, seq_len, -1).to(dtype)


class KosmosTextAttention(nn.Module):
    def __init__(self, config, embed_dim, num_heads, add_inner_attn_layernorm=True, share_kv=False):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.share_kv = share_kv
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        self.inner_attn_ln = None
        if add_inner_attn_layernorm:
            self.inner_attn_ln = nn.LayerNorm(embed_dim, eps=config.layer_norm_eps)

    def _shape(self, projection):
        new_shape = projection.size()[:-1] + (self.num_heads, self.head_dim)
        return projection.view(new_shape).permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask=None):
        bsz, tgt_len = hidden_states.shape[:2]
        current_states = hidden_states
        key_states = self._shape(self.k_proj(current_states))
        if self.share_kv:
            value_states = self._shape(self.k_proj(current_states))
        else:
            value_states = self._shape(self.v_proj(current_states))
        query_states = self._shape(self.q_proj(hidden_states) * self.scaling)
        attn_weights = torch.matmul(query_states, key_states.transpose(-1, -2))
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.permute(0, 2, 1, 3).contiguous().view(bsz, tgt_len, -1)
        if self.inner_attn_ln is not None:
            attn_output = self.inner_attn_ln(attn_output)
        return self.out_proj(attn_output)


class Kosmos2TextFFN(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.fc1 = nn.Linear(config.embed_dim, config.ffn_dim)
        self.fc2 = nn.Linear(config.ffn_dim, config.embed_dim)
        self.ffn_layernorm = nn.LayerNorm(config.ffn_dim, eps=config.layer_norm_eps)

    def forward(self, hidden_states):
        hidden_states = F.gelu(self.fc1(hidden_states))
        hidden_states = self.ffn_layernorm(hidden_states)
        return self.fc2(hidden_states)


class Kosmos2TextBlock(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = KosmosTextAttention(
            config, config.embed_dim, config.attention_heads,
            add_inner_attn_layernorm=True, share_kv=layer_idx in config.kv_shared_layers,
        )
        self.self_attn_layer_norm = nn.LayerNorm(config.embed_dim, eps=config.layer_norm_eps)
        self.ffn = Kosmos2TextFFN(config)
        self.final_layer_norm = nn.LayerNorm(config.embed_dim, eps=config.layer_norm_eps)

    def forward(self, hidden_states, attention_mask):
        residual = hidden_states
        hidden_states = self.self_attn(self.self_attn_layer_norm(hidden_states), attention_mask=attention_mask)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.ffn(self.final_layer_norm(hidden_states))
        return residual + hidden_states


class Kosmos2TextTransformer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_scale = math.sqrt(config.embed_dim) if config.scale_embedding else 1.0
        self.embed_tokens = nn.Embedding(config.vocab_size, config.embed_dim, padding_idx=config.pad_token_id)
        self.embed_positions = Kosmos2TextSinusoidalPositionalEmbedding(
            config.max_position_embeddings, config.embed_dim, config.pad_token_id
        )
        self.layers = nn.ModuleList([Kosmos2TextBlock(config, i) for i in range(config.layers)])
        self.layer_norm = nn.LayerNorm(config.embed_dim, eps=config.layer_norm_eps)

    def forward(self, input_ids):
        bsz, seq_len = input_ids.shape
        inputs_embeds = self.embed_tokens(input_ids) * self.embed_scale
        positions = self.embed_positions(input_ids, 0, dtype=inputs_embeds.dtype)
        hidden_states = inputs_embeds + positions
        dtype = hidden_states.dtype
        mask = torch.full((seq_len, seq_len), torch.finfo(dtype).min, dtype=dtype, device=input_ids.device)
        mask = torch.triu(mask, diagonal=1)[None, None].expand(bsz, 1, -1, -1)
        for layer in self.layers:
            hidden_states = layer(hidden_states, mask)
        return self.layer_norm(hidden_states)


class Kosmos2TextForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = Kosmos2TextTransformer(config)
        self.lm_head = nn.Linear(config.embed_dim, config.vocab_size, bias=False)

    def forward(self, input_ids):
        return self.lm_head(self.model(input_ids))


def make_model():
    torch.manual_seed(2105)
    config = SimpleNamespace(
        vocab_size=96, embed_dim=64, layers=3, ffn_dim=128, attention_heads=4,
        layer_norm_eps=1e-5, max_position_embeddings=64, scale_embedding=True, pad_token_id=1,
        kv_shared_layers=[1],
    )
    model = Kosmos2TextForCausalLM(config)
    g = torch.Generator().manual_seed(21051)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model.eval()

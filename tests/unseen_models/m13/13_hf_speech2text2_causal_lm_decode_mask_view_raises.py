"""Speech2Text2 text decoder used on its own, after transformers' modeling_speech_to_text_2.py
(Speech2Text2ForCausalLM).

Speech2Text2ForCausalLM: model.decoder (Speech2Text2Decoder: embed_tokens, embed_scale sqrt(d),
embed_positions = Speech2Text2SinusoidalPositionalEmbedding (padding_idx 1, offset 2, sin|cos halves),
layers.N = Speech2Text2DecoderLayer) and lm_head.  The decoder layer is post-norm: self_attn -> +
residual -> self_attn_layer_norm -> fc1 (ReLU) -> fc2 -> + residual -> final_layer_norm (no
encoder_attn: add_cross_attention False).  Speech2Text2Attention: q/k/v/out_proj with bias,
q_proj(h) * scaling, (bsz * heads, len, hd) bmm, additive causal mask (finfo.min) built by
_prepare_4d_causal_attention_mask with the past columns visible.
Cache: hf tuples.  `out = model(ids, use_cache=True)`, `model(tok, past_key_values=out.past_key_values,
use_cache=True)`; logits in `out.logits`; past is a tuple of per-layer `(k, v)` (b, h, s, d), cat on dim 2.
Slip: when adding the mask the attention reshapes the weights with
`attn_weights.view(bsz, self.num_heads, tgt_len, tgt_len)` (src_len mistyped as tgt_len).  Fine while
the keys are the queries (full forward, prompt); the first decoded token raises a RuntimeError
(shape '[b, 4, 1, 1]' is invalid for input of size b*4*(L+1)).
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
        "model.decoder.layers.0.self_attn",
        "model.decoder.layers.1.self_attn",
        "model.decoder.layers.2.self_attn",
    ],
    "kind": "causal-multihead",
    "cache": "hf",
    "decode": {"mistake": "cache_other", "step": 0, "layer": "model.decoder.layers.0.self_attn"},
    "style": "modeling_speech_to_text_2.py Speech2Text2ForCausalLM: embed_scale, offset-2 sinusoidal positions, "
    "post-norm, (bsz*heads) bmm attention, legacy (k, v) tuples; decode raises in view(bsz, h, tgt_len, tgt_len)",
}


class Speech2Text2SinusoidalPositionalEmbedding(nn.Module):
    def __init__(self, num_positions, embedding_dim, padding_idx):
        super().__init__()
        self.offset = 2
        self.embedding_dim, self.padding_idx = embedding_dim, padding_idx
        self.num_embeddings = num_positions + self.offset

    def get_embedding(self):
        half_dim = self.embedding_dim // 2
        emb = math.log(10000) / (half_dim - 1)
        emb = torch.exp(torch.arange(half_dim, dtype=torch.float64) * -emb)
        emb = torch.arange(self.num_embeddings, dtype=torch.float64)[:, None] * emb[None, :]
        emb = torch.cat([torch.sin(emb), torch.cos(emb)], dim=1)
        emb[self.padding_idx, :] = 0
        return emb

    def forward(self, input_ids, past_key_values_length=0):
        bsz, seq_len = input_ids.size()
        # no padding in these inputs: positions are padding_idx + 1 + (past .. past + seq_len - 1)
        positions = torch.arange(seq_len, device=input_ids.device) + past_key_values_length + self.padding_idx + 1
        return self.get_embedding()[positions].expand(bsz, -1, -1)


class Speech2Text2Attention(nn.Module):
    def __init__(self, embed_dim, num_heads):
        super().__init__()
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def _shape(self, tensor, seq_len, bsz):
        return tensor.view(bsz, seq_len, self.num_heads, self.head_dim).transpose(1, 2).contiguous()

    def forward(self, hidden_states, past_key_value=None, attention_mask=None):
        bsz, tgt_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states) * self.scaling
        key_states = self._shape(self.k_proj(hidden_states), -1, bsz)
        value_states = self._shape(self.v_proj(hidden_states), -1, bsz)
        if past_key_value is not None:
            key_states = torch.cat([past_key_value[0], key_states], dim=2)
            value_states = torch.cat([past_key_value[1], value_states], dim=2)
        past_key_value = (key_states, value_states)
        proj_shape = (bsz * self.num_heads, -1, self.head_dim)
        query_states = self._shape(query_states, tgt_len, bsz).view(*proj_shape)
        key_states = key_states.reshape(*proj_shape)
        value_states = value_states.reshape(*proj_shape)
        src_len = key_states.size(1)
        attn_weights = torch.bmm(query_states, key_states.transpose(1, 2))
        if attention_mask is not None:
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, tgt_len) + attention_mask
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_output = torch.bmm(attn_weights, value_states)
        attn_output = attn_output.view(bsz, self.num_heads, tgt_len, self.head_dim).transpose(1, 2)
        attn_output = attn_output.reshape(bsz, tgt_len, self.embed_dim)
        return self.out_proj(attn_output), past_key_value


class Speech2Text2DecoderLayer(nn.Module):
    def __init__(self, d_model=64, heads=4, ffn=128):
        super().__init__()
        self.self_attn = Speech2Text2Attention(d_model, heads)
        self.self_attn_layer_norm = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, ffn)
        self.fc2 = nn.Linear(ffn, d_model)
        self.final_layer_norm = nn.LayerNorm(d_model)

    def forward(self, hidden_states, attention_mask, past_key_value=None):
        residual = hidden_states
        hidden_states, present = self.self_attn(hidden_states, past_key_value, attention_mask)
        hidden_states = self.self_attn_layer_norm(residual + hidden_states)
        residual = hidden_states
        hidden_states = self.fc2(F.relu(self.fc1(hidden_states)))
        return self.final_layer_norm(residual + hidden_states), present


class Speech2Text2Decoder(nn.Module):
    def __init__(self, vocab=96, d_model=64, n_layers=3):
        super().__init__()
        self.embed_scale = math.sqrt(d_model)
        self.embed_tokens = nn.Embedding(vocab, d_model, padding_idx=1)
        self.embed_positions = Speech2Text2SinusoidalPositionalEmbedding(64, d_model, 1)
        self.layers = nn.ModuleList([Speech2Text2DecoderLayer() for _ in range(n_layers)])

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        bsz, T = input_ids.shape
        past_len = past_key_values[0][0].shape[2] if past_key_values is not None else 0
        inputs_embeds = self.embed_tokens(input_ids) * self.embed_scale
        dtype = inputs_embeds.dtype
        q_pos = torch.arange(past_len, past_len + T)
        k_pos = torch.arange(past_len + T)
        mask = torch.zeros(T, past_len + T, dtype=dtype).masked_fill(k_pos[None] > q_pos[:, None],
                                                                     torch.finfo(dtype).min)
        mask = mask[None, None].expand(bsz, 1, T, past_len + T)
        h = inputs_embeds + self.embed_positions(input_ids, past_len).to(dtype)
        presents = ()
        for i, layer in enumerate(self.layers):
            h, present = layer(h, mask, past_key_values[i] if past_key_values is not None else None)
            presents += (present,)
        return h, (presents if use_cache else None)


class Speech2Text2DecoderWrapper(nn.Module):
    def __init__(self):
        super().__init__()
        self.decoder = Speech2Text2Decoder()


class Speech2Text2ForCausalLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = Speech2Text2DecoderWrapper()
        self.lm_head = nn.Linear(64, 96, bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        h, presents = self.model.decoder(input_ids, past_key_values, use_cache)
        return SimpleNamespace(logits=self.lm_head(h), past_key_values=presents)


def make_model():
    torch.manual_seed(1313)
    model = Speech2Text2ForCausalLM()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.2 * torch.randn_like(m.weight))
                m.bias.copy_(0.05 * torch.randn_like(m.bias))
    return model.eval()

"""Nemotron in the shape of transformers' modeling_nemotron.py (written from memory, in my own
words): NemotronLayerNorm1P (LayerNorm whose effective gain is 1 + weight, with bias), partial
rotary (partial_rotary_factor 0.5: the first 8 of each 16-wide head, rotate_half pairing, base
10000), GQA 4 heads / 2 kv heads, squared-ReLU MLP (up_proj, down_proj), no qkv bias, 3 layers.  The
rotary module keeps the older transformers interface: `rotary_emb(value_states, seq_len=kv_seq_len)`
returns cos/sin tables for positions 0..kv_seq_len-1 and `apply_rotary_pos_emb` selects rows.

Cache (hf): out = model(prompt, use_cache=True); out = model(tok, past_key_values=out.past_key_values,
use_cache=True).  With use_cache=True the model creates a NemotronCache (defined below: update /
get_seq_length, key and value lists of (batch, kv_heads, seq, head_dim)).

Slip (decoding only): apply_rotary_pos_emb takes `cos[:q_len]` instead of `cos[position_ids]`, so
every decoded token (and its key) is rotated as position 0.  The full forward (no cache, positions
0..n-1) is exact.  Decode: `cache_positions`, step 0, `model.layers.0.self_attn`.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["model.layers.0.self_attn", "model.layers.1.self_attn", "model.layers.2.self_attn"],
    "kind": "causal-multihead",
    "cache": "hf",
    "decode": {"mistake": "cache_positions", "step": 0, "layer": "model.layers.0.self_attn"},
    "style": "modeling_nemotron.py: LayerNorm1P, partial rotary 0.5 (halves), GQA 4/2, relu^2 MLP, NemotronCache; "
    "slip: rotary rows sliced [:q_len] instead of indexed by position_ids",
}


class NemotronConfig:
    vocab_size = 130
    hidden_size = 64
    intermediate_size = 128
    num_hidden_layers = 3
    num_attention_heads = 4
    num_key_value_heads = 2
    head_dim = 16
    partial_rotary_factor = 0.5
    rope_theta = 10000.0
    norm_eps = 1e-5
    max_position_embeddings = 128


class NemotronCache:
    def __init__(self):
        self.key_cache = []
        self.value_cache = []

    def update(self, key_states, value_states, layer_idx):
        if len(self.key_cache) <= layer_idx:
            self.key_cache.append(key_states)
            self.value_cache.append(value_states)
        else:
            self.key_cache[layer_idx] = torch.cat([self.key_cache[layer_idx], key_states], dim=-2)
            self.value_cache[layer_idx] = torch.cat(
                [self.value_cache[layer_idx], value_states], dim=-2
            )
        return self.key_cache[layer_idx], self.value_cache[layer_idx]

    def get_seq_length(self, layer_idx=0):
        if len(self.key_cache) <= layer_idx:
            return 0
        return self.key_cache[layer_idx].shape[-2]


class NemotronLayerNorm1P(nn.LayerNorm):
    def forward(self, input):
        return F.layer_norm(input, self.normalized_shape, self.weight + 1, self.bias, self.eps)


class NemotronRotaryEmbedding(nn.Module):
    def __init__(self, dim, base):
        super().__init__()
        self.dim = dim
        self.register_buffer(
            "inv_freq",
            1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)),
            persistent=False,
        )

    def forward(self, x, seq_len):
        t = torch.arange(seq_len, dtype=torch.float64)
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids):
    q_len = q.shape[-2]
    cos = cos[:q_len].unsqueeze(0).unsqueeze(0)
    sin = sin[:q_len].unsqueeze(0).unsqueeze(0)
    rot_dim = cos.shape[-1]
    q, q_pass = q[..., :rot_dim], q[..., rot_dim:]
    k, k_pass = k[..., :rot_dim], k[..., rot_dim:]
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return torch.cat((q_embed, q_pass), dim=-1), torch.cat((k_embed, k_pass), dim=-1)


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    hidden_states = hidden_states[:, :, None, :, :].expand(
        batch, num_key_value_heads, n_rep, slen, head_dim
    )
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class NemotronAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.partial_rotary_factor = config.partial_rotary_factor
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(
            config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False
        )
        self.v_proj = nn.Linear(
            config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False
        )
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.rotary_emb = NemotronRotaryEmbedding(
            int(self.partial_rotary_factor * self.head_dim), config.rope_theta
        )

    def forward(self, hidden_states, attention_mask, position_ids, past_key_value=None):
        bsz, q_len, _ = hidden_states.size()
        query_states = (
            self.q_proj(hidden_states)
            .view(bsz, q_len, self.num_heads, self.head_dim)
            .transpose(1, 2)
        )
        key_states = (
            self.k_proj(hidden_states)
            .view(bsz, q_len, self.num_key_value_heads, self.head_dim)
            .transpose(1, 2)
        )
        value_states = (
            self.v_proj(hidden_states)
            .view(bsz, q_len, self.num_key_value_heads, self.head_dim)
            .transpose(1, 2)
        )
        kv_seq_len = q_len
        if past_key_value is not None:
            kv_seq_len += past_key_value.get_seq_length(self.layer_idx)
        cos, sin = self.rotary_emb(value_states, seq_len=kv_seq_len)
        query_states, key_states = apply_rotary_pos_emb(
            query_states, key_states, cos, sin, position_ids
        )
        if past_key_value is not None:
            key_states, value_states = past_key_value.update(
                key_states, value_states, self.layer_idx
            )
        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / (self.head_dim**0.5)
        attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).contiguous().reshape(bsz, q_len, -1)
        return self.o_proj(attn_output), attn_weights, past_key_value


class NemotronMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(torch.relu(self.up_proj(x)) ** 2)


class NemotronDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = NemotronAttention(config, layer_idx)
        self.mlp = NemotronMLP(config)
        self.input_layernorm = NemotronLayerNorm1P(config.hidden_size, eps=config.norm_eps)
        self.post_attention_layernorm = NemotronLayerNorm1P(config.hidden_size, eps=config.norm_eps)

    def forward(self, hidden_states, attention_mask, position_ids, past_key_value):
        residual = hidden_states
        hidden_states, _, _ = self.self_attn(
            self.input_layernorm(hidden_states), attention_mask, position_ids, past_key_value
        )
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class NemotronModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [NemotronDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = NemotronLayerNorm1P(config.hidden_size, eps=config.norm_eps)

    def forward(self, input_ids, past_key_values=None):
        bsz, seq_len = input_ids.shape
        inputs_embeds = self.embed_tokens(input_ids)
        past_seen_tokens = past_key_values.get_seq_length() if past_key_values is not None else 0
        cache_position = torch.arange(past_seen_tokens, past_seen_tokens + seq_len)
        position_ids = cache_position.unsqueeze(0)
        dtype = inputs_embeds.dtype
        target_length = past_seen_tokens + seq_len
        causal_mask = torch.zeros(seq_len, target_length, dtype=dtype)
        future = torch.arange(target_length)[None, :] > cache_position[:, None]
        causal_mask = causal_mask.masked_fill(future, torch.finfo(dtype).min)[None, None]
        hidden_states = inputs_embeds
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(hidden_states, causal_mask, position_ids, past_key_values)
        return self.norm(hidden_states)


class CausalLMOutputWithPast:
    def __init__(self, logits, past_key_values):
        self.logits = logits
        self.past_key_values = past_key_values


class NemotronForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = NemotronModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        if use_cache and past_key_values is None:
            past_key_values = NemotronCache()
        hidden_states = self.model(input_ids, past_key_values if use_cache else None)
        return CausalLMOutputWithPast(
            self.lm_head(hidden_states), past_key_values if use_cache else None
        )


def make_model():
    torch.manual_seed(6212)
    model = NemotronForCausalLM(NemotronConfig())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, NemotronLayerNorm1P):
                m.weight.copy_(0.3 * torch.randn_like(m.weight))
                m.bias.copy_(0.1 * torch.randn_like(m.bias))
    return model.eval()

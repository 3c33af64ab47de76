"""Moonshine's decoder (usefulsensors/moonshine, transformers' modeling_moonshine.py) used as a
causal LM.

MoonshineForCausalLM: model.decoder (embed_tokens, rotary_emb, layers.N, norm) and proj_out;
the encoder
and each layer's encoder_attn are not built.  MoonshineDecoderLayer: input_layernorm ->
self_attn,
final_layernorm -> mlp (fc1 to 2 x intermediate, chunk, silu(gate) * hidden, fc2); LayerNorms
without bias.
MoonshineAttention: q_proj / k_proj / v_proj / o_proj without bias, 6 query heads and 2
key/value heads
(repeat_kv), head_dim 16, scaling head_dim**-0.5, partial rotary: partial_rotary_factor 0.75 ->
the first
12 features of each head rotated in interleaved pairs (rotate_half = stack(-x[1::2], x[0::2]));
MoonshineRotaryEmbedding returns cat(freqs, freqs) tables (float64, cast), which
apply_rotary_pos_emb
cuts to their first half and repeat_interleave's.  Mask: additive finfo.min for key slot >
cache_position.
Cache: hf.  `out = model(ids, use_cache=True)` makes a MoonshineStaticCache (per-layer (b, 2,
64, 16)
slabs, index_copy_ at cache_position, whole slabs attended, unwritten slots masked); pass
`out.past_key_values` back.  Logits in `out.logits`.
Slip: the single-token decode branch (a token arriving with something cached) calls
past_key_value.update(value_states, key_states, ...): a decoded
token's value is written into the key slab and its key into the value slab, and attention reads
them back.
Prompt calls (more than one token) write the right slabs.  Full forward and prompt pass exact."""

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
    "style": "usefulsensors Moonshine decoder (transformers modeling_moonshine.py) without its "
    "encoder: bias-free LayerNorms, q/k/v/o_proj, GQA 6/2 via repeat_kv, partial rotary "
    "0.75 with interleaved pairs (tables cat(freqs, freqs) cut to the first half and "
    "repeat_interleave'd), gated SiLU fc1/fc2 MLP, static pre-allocated cache with "
    "index_copy_ at cache_position, finfo.min mask over all 64 slots; slip: one-token "
    "update() called with key and value swapped",
}


class MoonshineStaticCache:
    """Pre-allocated (batch, kv_heads, max_cache_len, head_dim) key/value slabs per layer.

    update() writes the new states at `cache_position` with index_copy_ and returns the whole slabs;
    unwritten slots are hidden by the mask the decoder builds from cache_position.
    """

    def __init__(self, num_layers, max_cache_len=64):
        self.num_layers = num_layers
        self.max_cache_len = max_cache_len
        self.key_cache = [None] * num_layers
        self.value_cache = [None] * num_layers
        self.seen_tokens = 0

    def get_seq_length(self, layer_idx=0):
        return self.seen_tokens

    def update(self, key_states, value_states, layer_idx, cache_kwargs):
        cache_position = cache_kwargs["cache_position"]
        if int(cache_position[-1]) >= self.max_cache_len:
            raise ValueError("static cache is full")
        if self.key_cache[layer_idx] is None:
            b, h, _, d = key_states.shape
            shape = (b, h, self.max_cache_len, d)
            self.key_cache[layer_idx] = key_states.new_zeros(shape)
            self.value_cache[layer_idx] = value_states.new_zeros(shape)
        self.key_cache[layer_idx].index_copy_(2, cache_position, key_states)
        self.value_cache[layer_idx].index_copy_(2, cache_position, value_states)
        if layer_idx == self.num_layers - 1:
            self.seen_tokens = int(cache_position[-1]) + 1
        return self.key_cache[layer_idx], self.value_cache[layer_idx]


class MoonshineRotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        head_dim = config.hidden_size // config.num_attention_heads
        self.dim = int(head_dim * config.partial_rotary_factor)
        self.base = config.rope_theta

    def forward(self, x, position_ids):
        inv_freq = 1.0 / (
            self.base ** (torch.arange(0, self.dim, 2, dtype=torch.float64) / self.dim)
        )
        freqs = position_ids[..., None].to(torch.float64) * inv_freq.to(x.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    """Interleaved: (x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...)."""
    x1 = x[..., 0::2]
    x2 = x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    # the tables come as cat(freqs, freqs); keep the first half and interleave it
    cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)
    sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1)
    rotary_dim = cos.shape[-1]
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_embed = torch.cat([(q_rot * cos) + (rotate_half(q_rot) * sin), q_pass], dim=-1)
    k_embed = torch.cat([(k_rot * cos) + (rotate_half(k_rot) * sin), k_pass], dim=-1)
    return q_embed, k_embed


ROPE_FNS = {"moonshine": apply_rotary_pos_emb}


def repeat_kv(hidden_states, n_rep):
    b, kv, s, d = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(b, kv, n_rep, s, d)
    return hidden_states.reshape(b, kv * n_rep, s, d)


class MoonshineAttention(nn.Module):
    def __init__(self, config, layer_idx, rope_fn=apply_rotary_pos_emb):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.scaling = self.head_dim**-0.5
        self.is_causal = True
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(
            config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False
        )
        self.v_proj = nn.Linear(
            config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False
        )
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.rope_fn = rope_fn

    def forward(
        self,
        hidden_states,
        position_embeddings,
        attention_mask,
        past_key_value=None,
        cache_position=None,
    ):
        bsz, q_len, _ = hidden_states.shape
        query_states = (
            self.q_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        )
        key_states = self.k_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        value_states = (
            self.v_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        )
        cos, sin = position_embeddings
        query_states, key_states = self.rope_fn(query_states, key_states, cos, sin)
        if past_key_value is not None:
            cache_kwargs = {"cache_position": cache_position}
            if q_len == 1 and past_key_value.get_seq_length() > 0:
                key_states, value_states = past_key_value.update(
                    value_states, key_states, self.layer_idx, cache_kwargs
                )
            else:
                key_states, value_states = past_key_value.update(
                    key_states, value_states, self.layer_idx, cache_kwargs
                )
        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.scaling
        attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, -1)
        return self.o_proj(attn_output)


class MoonshineDecoderMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, 2 * config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, hidden_states):
        hidden_states, gate = self.fc1(hidden_states).chunk(2, dim=-1)
        return self.fc2(F.silu(gate) * hidden_states)


class MoonshineDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = MoonshineAttention(
            config, layer_idx, ROPE_FNS[config.rope_impl[layer_idx]]
        )
        self.mlp = MoonshineDecoderMLP(config)
        self.input_layernorm = nn.LayerNorm(config.hidden_size, bias=False)
        self.final_layernorm = nn.LayerNorm(config.hidden_size, bias=False)

    def forward(
        self, hidden_states, position_embeddings, attention_mask, past_key_value, cache_position
    ):
        residual = hidden_states
        hidden_states = self.self_attn(
            self.input_layernorm(hidden_states),
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            past_key_value=past_key_value,
            cache_position=cache_position,
        )
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.final_layernorm(hidden_states))


class MoonshineDecoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [MoonshineDecoderLayer(config, i) for i in range(config.decoder_num_hidden_layers)]
        )
        self.norm = nn.LayerNorm(config.hidden_size, bias=False)
        self.rotary_emb = MoonshineRotaryEmbedding(config)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        bsz, seq_len = input_ids.shape
        inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and past_key_values is None:
            past_key_values = MoonshineStaticCache(
                len(self.layers), self.config.max_position_embeddings
            )
        past_seen = past_key_values.get_seq_length() if past_key_values is not None else 0
        cache_position = torch.arange(past_seen, past_seen + seq_len, device=input_ids.device)
        position_ids = cache_position.unsqueeze(0)
        target_length = past_key_values.max_cache_len if past_key_values is not None else seq_len
        dtype = inputs_embeds.dtype
        key_index = torch.arange(target_length, device=input_ids.device)
        causal_mask = torch.zeros(seq_len, target_length, dtype=dtype, device=input_ids.device)
        causal_mask = causal_mask.masked_fill(
            key_index[None, :] > cache_position[:, None], torch.finfo(dtype).min
        )
        causal_mask = causal_mask[None, None].expand(bsz, 1, -1, -1)
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for layer in self.layers:
            hidden_states = layer(
                hidden_states,
                position_embeddings=position_embeddings,
                attention_mask=causal_mask,
                past_key_value=past_key_values,
                cache_position=cache_position,
            )
        return self.norm(hidden_states), (past_key_values if use_cache else None)


class MoonshineModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.decoder = MoonshineDecoder(config)


class MoonshineForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = MoonshineModel(config)
        self.proj_out = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        hidden, cache = self.model.decoder(
            input_ids, past_key_values=past_key_values, use_cache=use_cache
        )
        return SimpleNamespace(logits=self.proj_out(hidden), past_key_values=cache)


def make_model():
    torch.manual_seed(2913)
    config = SimpleNamespace(
        vocab_size=96,
        hidden_size=96,
        intermediate_size=192,
        num_attention_heads=6,
        num_key_value_heads=2,
        decoder_num_hidden_layers=3,
        partial_rotary_factor=0.75,
        rope_theta=10000.0,
        max_position_embeddings=64,
        rope_impl=["moonshine", "moonshine", "moonshine"],
    )
    model = MoonshineForCausalLM(config)
    g = torch.Generator().manual_seed(29131)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
        model.model.decoder.embed_tokens.weight.normal_(0.0, 1.0, generator=g)
    return model.eval()

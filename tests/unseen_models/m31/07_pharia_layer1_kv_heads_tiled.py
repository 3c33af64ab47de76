"""Aleph Alpha's Pharia-1-LLM in the Hugging Face layout (PhariaForCausalLM), written from the
published architecture: Llama-shaped, but with biases on q/k/v/o and on the MLP, LayerNorm (with
bias) instead of RMSNorm, a non-gated GELU MLP (up_proj -> gelu -> down_proj) and rotary theta 1e6.

Tree: model (embed_tokens, layers.N: input_layernorm -> self_attn -> +, post_attention_layernorm ->
mlp -> +; norm; rotary_emb), lm_head.  Attention (`model.layers.N.self_attn`): GQA 4 query heads
over 2 kv heads, halves
rotary (cos/sin made in float64 from position ids and cast), legacy (k, v) tuples concatenated
on dim 2, kv heads expanded repeat_kv style (query head h reads kv head h // groups), eager
matmul * head_dim**-0.5 plus an additive finfo.min causal mask sliced to the key length, softmax.
Cache ("hf"): `out = model(prompt, use_cache=True)`, then
`out = model(tok, past_key_values=out.past_key_values, use_cache=True)`; logits in `out.logits`.
`model(ids)` is the full forward (past_key_values None).  Positions start at the length of layer
0's cached keys.  More than 64 positions raise ValueError.
Slip: layer 1 (`tiled_kv_layers=(1,)`) expands its kv heads with `repeat(1, 2, 1, 1)`: query head h
reads kv head h % 2 instead of h // 2 (keys and values alike).  The same expansion is used when
decoding, so decoding agrees with its own full pass."""

from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["model.layers.0.self_attn", "model.layers.1.self_attn", "model.layers.2.self_attn"],
    "kind": "causal-multihead",
    "cache": "hf",
    "layer": "model.layers.1.self_attn",
    "stage": "scores",
    "mistake": "kv_group_mapping",
    "style": "Pharia as 03; layer 1 tiles the kv heads (h % 2)",
}


class PhariaRotaryEmbedding(nn.Module):
    """Halves-pairing rotary; cos/sin made in float64 from the position ids and cast."""

    def __init__(self, head_dim, base):
        super().__init__()
        self.head_dim = head_dim
        self.base = base

    def forward(self, x, position_ids):
        exponent = torch.arange(0, self.head_dim, 2, dtype=torch.float64, device=x.device)
        inv_freq = 1.0 / (self.base ** (exponent / self.head_dim))
        freqs = position_ids.to(torch.float64)[..., None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def repeat_kv(hidden_states, n_rep):
    batch, num_kv, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None].expand(batch, num_kv, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_kv * n_rep, slen, head_dim)


def tile_kv(hidden_states, n_rep):
    # A fused-kernel port's broadcast: copies of the whole kv block, one after the other.
    return hidden_states.repeat(1, n_rep, 1, 1)


class PhariaAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        bias = config.attention_bias
        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(
            self.hidden_size, self.num_key_value_heads * self.head_dim, bias=bias
        )
        self.v_proj = nn.Linear(
            self.hidden_size, self.num_key_value_heads * self.head_dim, bias=bias
        )
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=bias)
        self.expand_kv = tile_kv if layer_idx in config.tiled_kv_layers else repeat_kv
        self.prefill_only_cache = layer_idx in config.prefill_only_cache_layers

    def forward(
        self,
        hidden_states,
        position_embeddings,
        attention_mask=None,
        past_key_value=None,
        use_cache=False,
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
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        if past_key_value is not None:
            key_states = torch.cat((past_key_value[0], key_states), dim=2)
            value_states = torch.cat((past_key_value[1], value_states), dim=2)
        present = None
        if use_cache:
            if self.prefill_only_cache and past_key_value is not None and q_len == 1:
                present = past_key_value
            else:
                present = (key_states, value_states)

        key_states = self.expand_kv(key_states, self.num_key_value_groups)
        value_states = self.expand_kv(value_states, self.num_key_value_groups)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.scaling
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask[:, :, :, : key_states.shape[-2]]
        attn_weights = torch.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, -1)
        return self.o_proj(attn_output), present


class PhariaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(
            config.intermediate_size, config.hidden_size, bias=config.mlp_bias
        )

    def forward(self, x):
        return self.down_proj(F.gelu(self.up_proj(x)))


class PhariaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = PhariaAttention(config, layer_idx)
        self.mlp = PhariaMLP(config)
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(
        self, hidden_states, position_embeddings, attention_mask, past_key_value, use_cache
    ):
        residual = hidden_states
        hidden_states, present = self.self_attn(
            self.input_layernorm(hidden_states),
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            past_key_value=past_key_value,
            use_cache=use_cache,
        )
        hidden_states = residual + hidden_states
        hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states, present


class PhariaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            PhariaDecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.rotary_emb = PhariaRotaryEmbedding(
            config.hidden_size // config.num_attention_heads, config.rope_theta
        )

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        bsz, seq_len = input_ids.shape
        past_len = past_key_values[0][0].shape[2] if past_key_values is not None else 0
        if past_len + seq_len > self.config.max_position_embeddings:
            raise ValueError("sequence longer than max_position_embeddings")
        hidden_states = self.embed_tokens(input_ids)
        dtype = hidden_states.dtype
        position_ids = torch.arange(past_len, past_len + seq_len, device=input_ids.device)
        position_ids = position_ids[None].expand(bsz, -1)
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        key_pos = torch.arange(past_len + seq_len, device=input_ids.device)
        hidden = key_pos[None, :] > position_ids[0][:, None]
        mask = torch.zeros(seq_len, past_len + seq_len, dtype=dtype, device=input_ids.device)
        mask = mask.masked_fill(hidden, torch.finfo(dtype).min)
        mask = mask[None, None].expand(bsz, 1, -1, -1)
        next_cache = ()
        for idx, layer in enumerate(self.layers):
            past = past_key_values[idx] if past_key_values is not None else None
            hidden_states, present = layer(
                hidden_states, position_embeddings, mask, past, use_cache
            )
            next_cache += (present,)
        return self.norm(hidden_states), (next_cache if use_cache else None)


class PhariaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = PhariaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        hidden, cache = self.model(input_ids, past_key_values=past_key_values, use_cache=use_cache)
        return SimpleNamespace(logits=self.lm_head(hidden), past_key_values=cache)


def make_model():
    torch.manual_seed(3107)
    config = SimpleNamespace(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=160,
        num_attention_heads=4,
        max_position_embeddings=64,
        layer_norm_eps=1e-5,
        rope_theta=1000000.0,
        attention_bias=True,
        mlp_bias=True,
        num_hidden_layers=3,
        num_key_value_heads=2,
        tiled_kv_layers=(1,),
        prefill_only_cache_layers=(),
    )
    model = PhariaForCausalLM(config)
    g = torch.Generator().manual_seed(31071)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
            elif isinstance(m, nn.Linear) and m.bias is not None:
                m.bias.normal_(0.0, 0.1, generator=g)
    return model.eval()

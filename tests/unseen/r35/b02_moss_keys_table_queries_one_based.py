"""fnlp MOSS (MossAttention, CodeGen lineage): one fused qkv_proj whose output is cut into mp_num
model-parallel slices, each holding (query, value, key) in that order; heads split in
(batch, tokens, heads, head_dim) layout; GPT-J-style interleaved rotary (rotate_every_two,
repeat_interleave'd sin/cos from a float64 sinusoid table) on the first rotary_dim features
only; boolean causal buffer with torch.where(finfo.min); parallel attention+MLP block.

This file: one bug: the model numbers positions from 1 (as attention_mask.cumsum would) for the queries while the attention rotates the keys from its own 0-based table: queries one position ahead of keys."""

import math

import torch
from torch import nn


class MossConfig:
    n_embd = 64
    n_inner = 128
    n_head = 4
    rotary_dim = 8
    rotary_base = 10000.0
    n_positions = 128
    mp_num = 4
    layer_norm_epsilon = 1e-5


def create_sinusoidal_positions(num_pos, dim, base):
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    sinusoid_inp = torch.einsum("i , j -> i j", torch.arange(num_pos, dtype=torch.float64), inv_freq)
    return torch.cat((torch.sin(sinusoid_inp), torch.cos(sinusoid_inp)), dim=1)


def rotate_every_two(x):
    x1 = x[:, :, :, ::2]
    x2 = x[:, :, :, 1::2]
    x = torch.stack((-x2, x1), dim=-1)
    return x.flatten(-2)


def apply_rotary_pos_emb(tensor, sin, cos):
    sin = torch.repeat_interleave(sin[:, :, None, :], 2, 3)
    cos = torch.repeat_interleave(cos[:, :, None, :], 2, 3)
    return (tensor * cos) + (rotate_every_two(tensor) * sin)


class MossAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        max_positions = config.n_positions
        self.register_buffer(
            "causal_mask",
            torch.tril(torch.ones((max_positions, max_positions), dtype=torch.bool)).view(
                1, 1, max_positions, max_positions
            ),
            persistent=False,
        )
        self.embed_dim = config.n_embd
        self.num_attention_heads = config.n_head
        self.head_dim = self.embed_dim // self.num_attention_heads
        self.scale_attn = math.sqrt(self.head_dim)
        self.qkv_proj = nn.Linear(self.embed_dim, self.embed_dim * 3, bias=False)
        self.out_proj = nn.Linear(self.embed_dim, self.embed_dim, bias=False)
        self.mp_num = config.mp_num
        self.rotary_dim = config.rotary_dim
        self.register_buffer(
            "embed_positions",
            create_sinusoidal_positions(max_positions, self.rotary_dim, config.rotary_base),
            persistent=False,
        )

    def _split_heads(self, x, n_head, dim_head, mp_num):
        reshaped = x.reshape(x.shape[:-1] + (n_head // mp_num, dim_head))
        return reshaped.reshape(x.shape[:-2] + (-1,) + reshaped.shape[-1:])

    def _merge_heads(self, tensor, num_attention_heads, attn_head_size):
        tensor = tensor.permute(0, 2, 1, 3).contiguous()
        new_shape = tensor.size()[:-2] + (num_attention_heads * attn_head_size,)
        return tensor.view(new_shape)

    def _attn(self, query, key, value):
        query_length, key_length = query.size(-2), key.size(-2)
        causal_mask = self.causal_mask[:, :, key_length - query_length : key_length, :key_length]
        compute_dtype = torch.promote_types(query.dtype, torch.float32)
        query = query.to(compute_dtype)
        key = key.to(compute_dtype)
        attn_weights = torch.matmul(query, key.transpose(-1, -2))
        attn_weights = attn_weights / self.scale_attn
        mask_value = torch.finfo(attn_weights.dtype).min
        mask_value = torch.tensor(mask_value, dtype=attn_weights.dtype, device=attn_weights.device)
        attn_weights = torch.where(causal_mask, attn_weights, mask_value)
        attn_weights = nn.Softmax(dim=-1)(attn_weights)
        attn_weights = attn_weights.to(value.dtype)
        return torch.matmul(attn_weights, value)

    def forward(self, hidden_states, position_ids):
        qkv = self.qkv_proj(hidden_states)
        qkv_split = qkv.reshape(qkv.shape[:-1] + (self.mp_num, -1))
        local_dim = self.head_dim * self.num_attention_heads // self.mp_num
        query, value, key = torch.split(qkv_split, local_dim, dim=-1)
        query = self._split_heads(query, self.num_attention_heads, self.head_dim, mp_num=self.mp_num)
        key = self._split_heads(key, self.num_attention_heads, self.head_dim, mp_num=self.mp_num)
        value = self._split_heads(value, self.num_attention_heads, self.head_dim, mp_num=self.mp_num)
        value = value.permute(0, 2, 1, 3)

        sincos = self.embed_positions[position_ids].to(hidden_states.dtype)
        sin, cos = torch.split(sincos, sincos.shape[-1] // 2, dim=-1)

        k_rot = key[:, :, :, : self.rotary_dim]
        k_pass = key[:, :, :, self.rotary_dim :]
        q_rot = query[:, :, :, : self.rotary_dim]
        q_pass = query[:, :, :, self.rotary_dim :]
        # keys cover the whole (cached) sequence: positions 0 .. kv_len - 1
        key_sincos = self.embed_positions[: key.shape[1]][None].to(hidden_states.dtype)
        key_sin, key_cos = torch.split(key_sincos, key_sincos.shape[-1] // 2, dim=-1)
        k_rot = apply_rotary_pos_emb(k_rot, key_sin, key_cos)
        q_rot = apply_rotary_pos_emb(q_rot, sin, cos)
        key = torch.cat([k_rot, k_pass], dim=-1)
        query = torch.cat([q_rot, q_pass], dim=-1)

        key = key.permute(0, 2, 1, 3)
        query = query.permute(0, 2, 1, 3)

        attn_output = self._attn(query, key, value)
        attn_output = self._merge_heads(attn_output, self.num_attention_heads, self.head_dim)
        return self.out_proj(attn_output)


class MossMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.fc_in = nn.Linear(config.n_embd, config.n_inner)
        self.fc_out = nn.Linear(config.n_inner, config.n_embd)

    def forward(self, hidden_states):
        return self.fc_out(nn.functional.gelu(self.fc_in(hidden_states), approximate="tanh"))


class MossBlock(nn.Module):
    """Parallel residual: attention and MLP both read ln_1(x)."""

    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = MossAttention(config)
        self.mlp = MossMLP(config)

    def forward(self, hidden_states, position_ids):
        residual = hidden_states
        hidden_states = self.ln_1(hidden_states)
        attn_outputs = self.attn(hidden_states, position_ids)
        feed_forward_hidden_states = self.mlp(hidden_states)
        return attn_outputs + feed_forward_hidden_states + residual


class MossModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.h = nn.ModuleList([MossBlock(config)])
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)

    def forward(self, inputs_embeds):
        seq_length = inputs_embeds.shape[1]
        position_ids = torch.arange(1, seq_length + 1, dtype=torch.long, device=inputs_embeds.device)
        position_ids = position_ids.unsqueeze(0)
        hidden_states = inputs_embeds
        for block in self.h:
            hidden_states = block(hidden_states, position_ids)
        return self.ln_f(hidden_states)


def make_moss_model():
    torch.manual_seed(3512)
    model = MossModel(MossConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {
    "target": "make_moss_model",
    "kind": "causal-multihead",
    "ok": False,
    "layer": "h.0.attn",
    # corrected after the first run (which counted it a miss): the contract's rope_positions
    # is "not 0..n-1"; the keys are at 0..n-1 and the queries at 1..n, so the queries are
    # the side rotated for the wrong positions (the writer had "rotated_keys")
    "stage": "rotated_queries",
    "mistake": "rope_positions",
    "style": (
        "fnlp MOSS MossAttention: one bug: the model numbers positions from 1 (as "
        "attention_mask.cumsum would) for the queries while the attention rotates the "
        "keys from its own 0-based table: queries one position ahead of keys"
    ),
}


"""A tiny CodeGen in the style of Hugging Face's modeling_codegen.py.

CodeGenForCausalLM -> transformer (wte, h ModuleList of CodeGenBlock(ln_1, attn, mlp), ln_f)
+ lm_head with bias.  Parallel block: attention and MLP both read ln_1(x).  CodeGen's fused
qkv_proj layout: the output is reshaped into mp_num = 4 model-parallel shards and each shard
is split in the order (query, value, key), then _split_heads.  Rotary on the first
rotary_dim = 8 of 16 dims per head (fraction 0.5) with rotate_every_two (interleaved pairs)
and sin/cos gathered from embed_positions by position_ids.  The boolean causal_mask buffer is
sliced per call.  Legacy tuple cache of (key, value), each (b, heads, seq, head_dim).

Slip: _attn slices the causal mask buffer as causal_mask[:, :, :query_length, :key_length]
instead of [key_length - query_length : key_length].  With no cache the two agree.  On a
one-token step the only row left is row 0, so the new token sees just the first cached key.
"""

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["transformer.h.0.attn", "transformer.h.1.attn", "transformer.h.2.attn"],
    "kind": "causal-multihead",
    "cache": "hf",
    "decode": {"mistake": "cache_mask", "step": 0, "layer": "transformer.h.0.attn"},
    "style": "transformers modeling_codegen.py: mp_num=4 qkv shards split (q, v, k), rotate_every_two partial rotary, "
    "parallel block, tuple cache; slip: causal_mask[:, :, :q_len, :k_len] so a decoded token sees only key 0",
}


@dataclass
class CodeGenConfig:
    vocab_size: int = 128
    n_positions: int = 64
    n_embd: int = 64
    n_layer: int = 3
    n_head: int = 4
    rotary_dim: int = 8
    n_inner: Optional[int] = None
    layer_norm_epsilon: float = 1e-5


@dataclass
class CausalLMOutputWithPast:
    logits: torch.Tensor
    past_key_values: Optional[Tuple] = None


def create_sinusoidal_positions(num_pos, dim):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.int64) / dim))
    sinusoid_inp = torch.einsum(
        "i , j -> i j", torch.arange(num_pos, dtype=torch.int64).float(), inv_freq
    ).float()
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


class CodeGenAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        max_positions = config.n_positions
        self.register_buffer(
            "causal_mask",
            torch.tril(torch.ones((max_positions, max_positions), dtype=torch.bool)).view(
                1, 1, max_positions, max_positions
            ),
            persistent=False,
        )
        self.layer_idx = layer_idx
        self.embed_dim = config.n_embd
        self.num_attention_heads = config.n_head
        self.head_dim = self.embed_dim // self.num_attention_heads
        self.scale_attn = torch.sqrt(torch.tensor(self.head_dim, dtype=torch.float32)).to(
            torch.get_default_dtype()
        )
        self.qkv_proj = nn.Linear(self.embed_dim, self.embed_dim * 3, bias=False)
        self.out_proj = nn.Linear(self.embed_dim, self.embed_dim, bias=False)
        self.rotary_dim = config.rotary_dim
        pos_embd_dim = self.rotary_dim or self.embed_dim
        self.register_buffer(
            "embed_positions",
            create_sinusoidal_positions(max_positions, pos_embd_dim),
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
        causal_mask = self.causal_mask[:, :, :query_length, :key_length]
        attn_weights = torch.matmul(query, key.transpose(-1, -2))
        attn_weights = attn_weights / self.scale_attn.to(attn_weights.dtype)
        mask_value = torch.finfo(attn_weights.dtype).min
        mask_value = torch.tensor(mask_value, dtype=attn_weights.dtype)
        attn_weights = torch.where(causal_mask, attn_weights, mask_value)
        attn_weights = nn.Softmax(dim=-1)(attn_weights)
        attn_weights = attn_weights.to(value.dtype)
        return torch.matmul(attn_weights, value), attn_weights

    def forward(self, hidden_states, layer_past=None, position_ids=None, use_cache=False):
        qkv = self.qkv_proj(hidden_states)
        mp_num = 4
        qkv_split = qkv.reshape(qkv.shape[:-1] + (mp_num, -1))
        local_dim = self.head_dim * self.num_attention_heads // mp_num
        query, value, key = torch.split(qkv_split, local_dim, dim=-1)
        query = self._split_heads(query, self.num_attention_heads, self.head_dim, mp_num=mp_num)
        key = self._split_heads(key, self.num_attention_heads, self.head_dim, mp_num=mp_num)
        value = self._split_heads(value, self.num_attention_heads, self.head_dim, mp_num=mp_num)
        value = value.permute(0, 2, 1, 3)

        sincos = self.embed_positions[position_ids].to(hidden_states.dtype)
        sin, cos = torch.split(sincos, sincos.shape[-1] // 2, dim=-1)
        if self.rotary_dim is not None:
            k_rot = key[:, :, :, : self.rotary_dim]
            k_pass = key[:, :, :, self.rotary_dim :]
            q_rot = query[:, :, :, : self.rotary_dim]
            q_pass = query[:, :, :, self.rotary_dim :]
            k_rot = apply_rotary_pos_emb(k_rot, sin, cos)
            q_rot = apply_rotary_pos_emb(q_rot, sin, cos)
            key = torch.cat([k_rot, k_pass], dim=-1)
            query = torch.cat([q_rot, q_pass], dim=-1)
        key = key.permute(0, 2, 1, 3)
        query = query.permute(0, 2, 1, 3)

        if layer_past is not None:
            past_key, past_value = layer_past
            key = torch.cat((past_key, key), dim=-2)
            value = torch.cat((past_value, value), dim=-2)
        present = (key.to(hidden_states.dtype), value) if use_cache else None

        attn_output, attn_weights = self._attn(query, key, value)
        attn_output = self._merge_heads(attn_output, self.num_attention_heads, self.head_dim)
        attn_output = self.out_proj(attn_output)
        return attn_output, present


class CodeGenMLP(nn.Module):
    def __init__(self, intermediate_size, config):
        super().__init__()
        self.fc_in = nn.Linear(config.n_embd, intermediate_size)
        self.fc_out = nn.Linear(intermediate_size, config.n_embd)

    def forward(self, hidden_states):
        return self.fc_out(F.gelu(self.fc_in(hidden_states), approximate="tanh"))


class CodeGenBlock(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        inner_dim = config.n_inner if config.n_inner is not None else 4 * config.n_embd
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = CodeGenAttention(config, layer_idx)
        self.mlp = CodeGenMLP(inner_dim, config)

    def forward(self, hidden_states, layer_past=None, position_ids=None, use_cache=False):
        residual = hidden_states
        hidden_states = self.ln_1(hidden_states)
        attn_output, present = self.attn(
            hidden_states, layer_past=layer_past, position_ids=position_ids, use_cache=use_cache
        )
        feed_forward_hidden_states = self.mlp(hidden_states)
        return attn_output + feed_forward_hidden_states + residual, present


class CodeGenModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.h = nn.ModuleList([CodeGenBlock(config, i) for i in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)

    def forward(self, input_ids, past_key_values=None, position_ids=None, use_cache=False):
        seq_length = input_ids.shape[-1]
        if past_key_values is None:
            past_length = 0
            past_key_values = tuple([None] * len(self.h))
        else:
            past_length = past_key_values[0][0].size(-2)
        if position_ids is None:
            position_ids = torch.arange(
                past_length, seq_length + past_length, dtype=torch.long
            ).unsqueeze(0)
        hidden_states = self.wte(input_ids)
        presents = () if use_cache else None
        for block, layer_past in zip(self.h, past_key_values):
            hidden_states, present = block(
                hidden_states, layer_past=layer_past, position_ids=position_ids, use_cache=use_cache
            )
            if use_cache:
                presents = presents + (present,)
        return self.ln_f(hidden_states), presents


class CodeGenForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.transformer = CodeGenModel(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size)

    def forward(self, input_ids, past_key_values=None, position_ids=None, use_cache=False):
        hidden_states, presents = self.transformer(
            input_ids,
            past_key_values=past_key_values,
            position_ids=position_ids,
            use_cache=use_cache,
        )
        lm_logits = self.lm_head(hidden_states).to(torch.float32)
        return CausalLMOutputWithPast(logits=lm_logits, past_key_values=presents)


def make_model():
    torch.manual_seed(1717)
    model = CodeGenForCausalLM(CodeGenConfig())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn_like(m.weight))
                m.bias.copy_(0.1 * torch.randn_like(m.bias))
    return model.eval()

"""SGLang (inference engine) `LlamaAttention` on its flattened token axis: `QKVParallelLinear` at TP
size 1 split `[q_size, kv_size, kv_size]`, a `get_rope`-style `RotaryEmbedding` with `cos_sin_cache`
and `forward_native` on `[num_tokens, heads * head_size]`, `RadixAttention` dispatching to the
torch_native backend's extend path (one SDPA per request, `enable_gqa`, `scale=layer.scaling`,
`is_causal`), `o_proj`. The model body flattens `(batch, tokens)` into requests of equal length and
builds `ForwardBatch.positions`.

This file: refused (xPos: after the rotation, queries are multiplied and keys divided by a per-
frequency decay zeta^(position / 32), so scores decay with distance on top of the rotation)."""

import math
from dataclasses import dataclass
from typing import List

import torch
import torch.nn.functional as F
from torch import nn

class LlamaConfig:
    hidden_size = 64
    num_attention_heads = 8
    num_key_value_heads = 4
    rope_theta = 500000.0
    max_position_embeddings = 128

@dataclass
class ForwardBatch:
    """The part of SGLang's ForwardBatch an extend (prefill) step needs: tokens of all requests
    flattened into one axis, with per-request lengths."""

    extend_seq_lens: List[int]
    positions: torch.Tensor

class RotaryEmbedding(nn.Module):
    """SGLang/vLLM-style rotary: cos_sin_cache[max_pos, rotary_dim] = cat(cos, sin), forward_native
    on flattened [num_tokens, heads * head_size] q/k; neox style rotates halves."""

    def __init__(self, head_size, rotary_dim, max_position_embeddings, base, is_neox_style):
        super().__init__()
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.is_neox_style = is_neox_style
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
        t = torch.arange(max_position_embeddings, dtype=torch.float64)
        freqs = torch.einsum("i,j->ij", t, inv_freq)
        self.register_buffer("cos_sin_cache", torch.cat((freqs.cos(), freqs.sin()), dim=-1), persistent=False)
        # xPos (torchscale): per-frequency decay, queries scaled by zeta^(n/scale_base), keys by its inverse
        zeta = (torch.arange(0, rotary_dim, 2, dtype=torch.float64) + 0.4 * rotary_dim) / (1.4 * rotary_dim)
        power = (t - max_position_embeddings // 2) / 32.0
        self.register_buffer("xpos_scale", zeta[None, :] ** power[:, None], persistent=False)

    @staticmethod
    def _apply_rotary_emb(x, cos, sin, is_neox_style):
        cos = cos.unsqueeze(-2).to(x.dtype)
        sin = sin.unsqueeze(-2).to(x.dtype)
        if is_neox_style:
            x1, x2 = torch.chunk(x, 2, dim=-1)
        else:
            x1, x2 = x[..., ::2], x[..., 1::2]
        o1 = x1 * cos - x2 * sin
        o2 = x2 * cos + x1 * sin
        if is_neox_style:
            return torch.cat((o1, o2), dim=-1)
        return torch.stack((o1, o2), dim=-1).flatten(-2)

    def forward(self, positions, query, key):
        num_tokens = positions.shape[0]
        cos_sin = self.cos_sin_cache.index_select(0, positions)
        cos, sin = cos_sin.chunk(2, dim=-1)
        query_shape = query.shape
        query = query.view(num_tokens, -1, self.head_size)
        query_rot = query[..., : self.rotary_dim]
        query_pass = query[..., self.rotary_dim :]
        query_rot = self._apply_rotary_emb(query_rot, cos, sin, self.is_neox_style)
        query = torch.cat((query_rot, query_pass), dim=-1).reshape(query_shape)
        key_shape = key.shape
        key = key.view(num_tokens, -1, self.head_size)
        key_rot = key[..., : self.rotary_dim]
        key_pass = key[..., self.rotary_dim :]
        key_rot = self._apply_rotary_emb(key_rot, cos, sin, self.is_neox_style)
        key = torch.cat((key_rot, key_pass), dim=-1).reshape(key_shape)
        scale = self.xpos_scale.index_select(0, positions).to(query.dtype)
        scale = torch.cat((scale, scale), dim=-1)  # neox layout: one factor per pair, both halves
        query = (query.view(num_tokens, -1, self.head_size) * scale[:, None, :]).reshape(query_shape)
        key = (key.view(num_tokens, -1, self.head_size) / scale[:, None, :]).reshape(key_shape)
        return query, key

class TorchNativeAttnBackend:
    """SGLang's torch_native backend, extend path, without the paged KV pool: one SDPA per request."""

    def forward_extend(self, q, k, v, layer, forward_batch):
        num_tokens = q.shape[0]
        q = q.view(num_tokens, layer.tp_q_head_num, layer.qk_head_dim)
        k = k.view(num_tokens, layer.tp_k_head_num, layer.qk_head_dim)
        v = v.view(num_tokens, layer.tp_v_head_num, layer.v_head_dim)
        out = torch.empty_like(q)
        enable_gqa = layer.tp_q_head_num != layer.tp_k_head_num
        start = 0
        for seq_len in forward_batch.extend_seq_lens:
            end = start + seq_len
            per_req_q = q[start:end].movedim(0, 1).unsqueeze(0)
            per_req_k = k[start:end].movedim(0, 1).unsqueeze(0)
            per_req_v = v[start:end].movedim(0, 1).unsqueeze(0)
            per_req_out = F.scaled_dot_product_attention(
                per_req_q, per_req_k, per_req_v, enable_gqa=enable_gqa, scale=layer.scaling, is_causal=layer.is_causal
            )
            out[start:end] = per_req_out.squeeze(0).movedim(1, 0)
            start = end
        return out.view(num_tokens, layer.tp_q_head_num * layer.v_head_dim)

class RadixAttention(nn.Module):
    def __init__(self, num_heads, head_dim, scaling, num_kv_heads, layer_id):
        super().__init__()
        self.tp_q_head_num = num_heads
        self.tp_k_head_num = num_kv_heads
        self.tp_v_head_num = num_kv_heads
        self.qk_head_dim = head_dim
        self.v_head_dim = head_dim
        self.scaling = scaling
        self.layer_id = layer_id
        self.is_causal = True
        self.backend = TorchNativeAttnBackend()

    def forward(self, q, k, v, forward_batch):
        return self.backend.forward_extend(q, k, v, self, forward_batch)

class LlamaAttention(nn.Module):
    def __init__(self, config, layer_id=0):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.total_num_heads = config.num_attention_heads
        self.total_num_kv_heads = config.num_key_value_heads
        self.num_heads = self.total_num_heads
        self.num_kv_heads = self.total_num_kv_heads
        self.head_dim = self.hidden_size // self.total_num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scaling = self.head_dim**-0.5
        # QKVParallelLinear / RowParallelLinear at tensor-parallel size 1
        self.qkv_proj = nn.Linear(self.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, self.hidden_size, bias=False)
        self.rotary_emb = RotaryEmbedding(
            self.head_dim, self.head_dim, config.max_position_embeddings, config.rope_theta, is_neox_style=True
        )

        self.attn = RadixAttention(self.num_heads, self.head_dim, self.scaling, self.num_kv_heads, layer_id)

    def forward(self, positions, hidden_states, forward_batch):
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)

        attn_output = self.attn(q, k, v, forward_batch)
        return self.o_proj(attn_output)

class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_id=0):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id)

class LlamaModel(nn.Module):
    """Takes (batch, tokens, hidden), flattens the requests into SGLang's token axis and builds
    ForwardBatch.positions per request (0..n-1, no cached prefix)."""

    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, 0)])

    def forward(self, inputs_embeds):
        bsz, seq_len, hidden = inputs_embeds.shape
        extend_seq_lens = [seq_len] * bsz
        positions = torch.cat([torch.arange(n, device=inputs_embeds.device) for n in extend_seq_lens])
        forward_batch = ForwardBatch(extend_seq_lens=extend_seq_lens, positions=positions)
        hidden_states = inputs_embeds.reshape(bsz * seq_len, hidden)
        for layer in self.layers:
            hidden_states = layer.self_attn(positions, hidden_states, forward_batch)
        return hidden_states.view(bsz, seq_len, hidden)

def make_sglang_xpos():
    torch.manual_seed(1656)
    model = LlamaModel(LlamaConfig())

    return model.eval()


EXPECT = {
    "target": "make_sglang_xpos",
    "kind": "causal-multihead",
    "ok": True,
    "layer": "layers.0.self_attn",
    "unsupported": "xpos",
    "style": "SGLang-style RotaryEmbedding carrying torchscale's xPos decay (q * zeta^n, k / zeta^n) on neox halves"
}

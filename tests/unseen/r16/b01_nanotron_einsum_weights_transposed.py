"""nanotron (Hugging Face's 3D-parallel trainer) Llama `CausalSelfAttention`, sequence-first [seq,
batch, hidden], fused `qkv_proj` split by `torch.split`, its own cached rotary (interleaved by
default, halves with `rope_interleaved=False`), a plain-torch stand-in for the flash-attn varlen
core (GQA by `repeat_interleave`, einsum scores, finfo.min causal fill).

This file: one bug: the context einsum is written "bhkq,bkhd->bqhd" (query and key letters swapped
on the probabilities), so each output sums the weights column, not the row, against the values."""

import torch
from torch import nn

class LlamaConfig:
    hidden_size = 64
    num_attention_heads = 8
    num_key_value_heads = 2
    rope_theta = 10000.0
    rope_interleaved = True
    max_position_embeddings = 128

class RotaryEmbedding(nn.Module):
    """nanotron-style rotary: a cached table of angles, interleaved pairs by default
    (rope_interleaved=False rotates the two halves of the head instead)."""

    def __init__(self, dim, end, theta, interleaved):
        super().__init__()
        self.dim = dim
        self.interleaved = interleaved
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        t = torch.arange(end, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)
        self.register_buffer("freqs_cos", freqs.cos(), persistent=False)
        self.register_buffer("freqs_sin", freqs.sin(), persistent=False)

    def forward(self, x, position_ids):
        # x: [batch, seq, heads, d_qk]; position_ids: [batch, seq]
        cos = self.freqs_cos[position_ids].to(x.dtype)[:, :, None, :]
        sin = self.freqs_sin[position_ids].to(x.dtype)[:, :, None, :]
        if self.interleaved:
            x0, x1 = x.unflatten(-1, (-1, 2)).unbind(-1)
            return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)
        x0, x1 = x.chunk(2, dim=-1)
        return torch.cat((x0 * cos - x1 * sin, x1 * cos + x0 * sin), dim=-1)

class CoreAttention(nn.Module):
    """Stand-in for nanotron's flash_attn_varlen_func call: plain torch, GQA by repeat_interleave."""

    def __init__(self, d_qk):
        super().__init__()
        self.softmax_scale = d_qk ** -0.5

    def forward(self, query_states, key_states, value_states):
        # [batch, seq, heads, d] in, [batch, seq, heads, d] out
        n_rep = query_states.shape[2] // key_states.shape[2]
        key_states = key_states.repeat_interleave(n_rep, dim=2)
        value_states = value_states.repeat_interleave(n_rep, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", query_states, key_states) * self.softmax_scale
        q_len, k_len = scores.shape[-2:]
        causal = torch.ones(q_len, k_len, dtype=torch.bool, device=scores.device).tril(k_len - q_len)
        scores = scores.masked_fill(~causal, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1)
        return torch.einsum("bhkq,bkhd->bqhd", probs, value_states)

class CausalSelfAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.n_local_q_heads = config.num_attention_heads
        self.n_local_kv_heads = config.num_key_value_heads
        self.d_qk = config.hidden_size // config.num_attention_heads
        self.d_v = self.d_qk
        self.layer_idx = layer_idx
        self.qkv_proj = nn.Linear(
            config.hidden_size,
            (self.n_local_q_heads + 2 * self.n_local_kv_heads) * self.d_qk,
            bias=False,
        )
        self.rotary_embedding = RotaryEmbedding(
            self.d_qk, config.max_position_embeddings, config.rope_theta, config.rope_interleaved
        )
        self.attention = CoreAttention(self.d_qk)
        self.o_proj = nn.Linear(self.n_local_q_heads * self.d_v, config.hidden_size, bias=False)

    def forward(self, hidden_states, sequence_mask, position_ids):
        # hidden_states: [seq_length, batch_size, hidden_size] (nanotron is sequence-first)
        qkv_states = self.qkv_proj(hidden_states)
        q_length, batch_size, _ = qkv_states.shape
        query_states, key_states, value_states = torch.split(
            qkv_states,
            [
                self.n_local_q_heads * self.d_qk,
                self.n_local_kv_heads * self.d_qk,
                self.n_local_kv_heads * self.d_qk,
            ],
            dim=-1,
        )
        query_states = query_states.transpose(0, 1).contiguous().view(
            batch_size, q_length, self.n_local_q_heads, self.d_qk
        )
        key_states = key_states.transpose(0, 1).contiguous().view(
            batch_size, q_length, self.n_local_kv_heads, self.d_qk
        )
        value_states = value_states.transpose(0, 1).contiguous().view(
            batch_size, q_length, self.n_local_kv_heads, self.d_v
        )
        # no KV cache in training: the keys start at offset 0
        kv_length = key_states.shape[1]
        query_position_ids = position_ids + (kv_length - q_length)
        query_states = self.rotary_embedding(query_states, position_ids=query_position_ids)
        key_states = self.rotary_embedding(key_states, position_ids=position_ids)

        attention_output = self.attention(query_states, key_states, value_states)
        attention_output = (
            attention_output.contiguous()
            .view(batch_size, q_length, self.n_local_q_heads * self.d_v)
            .transpose(0, 1)
        )
        output = self.o_proj(attention_output)
        return {"hidden_states": output, "sequence_mask": sequence_mask}

class LlamaModel(nn.Module):
    """Thin nanotron-like body: builds position_ids and a sequence mask, runs sequence-first."""

    def __init__(self, config):
        super().__init__()
        self.decoder = nn.ModuleList([nn.ModuleDict({"attn": CausalSelfAttention(config, 0)})])

    def forward(self, inputs_embeds):
        batch_size, seq_length, _ = inputs_embeds.shape
        sequence_mask = torch.ones(batch_size, seq_length, dtype=torch.bool, device=inputs_embeds.device)
        position_ids = torch.cumsum(sequence_mask, dim=-1, dtype=torch.int64) - 1
        hidden_states = inputs_embeds.transpose(0, 1)
        for block in self.decoder:
            out = block["attn"](hidden_states, sequence_mask, position_ids)
            hidden_states = out["hidden_states"]
        return hidden_states.transpose(0, 1)

def make_nanotron_llama():
    torch.manual_seed(1603)
    return LlamaModel(LlamaConfig()).eval()


EXPECT = {
    "target": "make_nanotron_llama",
    "kind": "causal-multihead",
    "ok": False,
    "layer": "decoder.0.attn",
    "stage": "context",
    "mistake": "context_wrong_product",
    "style": "nanotron Llama core: einsum 'bhkq,bkhd->bqhd' combines transposed weights with the values"
}

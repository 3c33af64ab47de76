"""A tiny GPT-NeoX in the style of EleutherAI's gpt-neox repository (megatron/model), not HF.

GPTNeoXLM -> embed (word_embeddings) -> layers ModuleList of ParallelTransformerLayer -> final_norm
-> tied logits.  Sequence-first layout everywhere: hidden states are [sq, b, h] inside the model
(the public forward takes and returns batch-first).  ParallelSelfAttention: query_key_value
Linear(h, 3h) viewed [sq, b, np, 3 * hn] and split per head; rotary_pct 0.5 (8 of 16 dims,
rotate_half, base 10000) with the [sq, 1, 1, rot] cos/sin cache; baddbmm with
alpha = 1 / norm_factor over [b * np, sq, sk]; boolean upper-triangular mask filled with finfo.min
(megatron's FusedScaleMaskSoftmax); dense out.  gpt_j_residual (parallel attention + MLP).
neox_args.attention_config expands to per-layer types ["global", "flash", "global"].

Slip: the "flash" branch (layer 1) sizes its rotary table for sk + sq positions and takes the last
sq rows for the queries and the first sk rows for the keys; without a cache the queries are rotated
at n..2n-1 while the keys are at 0..n-1.  layers.1.attention, rotated_queries, rope_positions.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["layers.0.attention", "layers.1.attention", "layers.2.attention"],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "layers.1.attention",
    "stage": "rotated_queries",
    "mistake": "rope_positions",
    "style": "EleutherAI gpt-neox megatron/model/transformer.py: [sq, b, np, 3hn] fused qkv, rotary_pct 0.5, "
    "baddbmm/norm_factor, per-layer attention_config; slip: flash layer rotates queries at sk..sk+sq-1",
}


class NeoXArgs:
    hidden_size = 64
    num_attention_heads = 4
    num_layers = 3
    padded_vocab_size = 128
    rotary_pct = 0.5
    rotary_emb_base = 10000
    max_position_embeddings = 64
    layernorm_epsilon = 1e-5
    attention_config = ["global", "flash", "global"]


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, max_seq_len, base=10000):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.max_seq_len = max_seq_len

    def forward(self, x, seq_dim=0, seq_len=None):
        t = torch.arange(seq_len, device=x.device).type_as(self.inv_freq)
        freqs = torch.einsum("i,j->ij", t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1).to(x.dtype)
        return emb.cos()[:, None, None, :], emb.sin()[:, None, None, :]


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=x1.ndim - 1)


def apply_rotary_pos_emb_torch(q, k, cos, sin, offset: int = 0):
    cos, sin = cos[offset : q.shape[0] + offset, ...], sin[offset : q.shape[0] + offset, ...]
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class ParallelSelfAttention(nn.Module):
    def __init__(self, neox_args, layer_number):
        super().__init__()
        self.hidden_size_per_partition = neox_args.hidden_size
        self.num_attention_heads_per_partition = neox_args.num_attention_heads
        self.hidden_size_per_attention_head = neox_args.hidden_size // neox_args.num_attention_heads
        self.norm_factor = self.hidden_size_per_attention_head**0.5
        self.attention_type = neox_args.attention_config[layer_number]
        self.use_flash_attention = self.attention_type == "flash"
        self.rotary_ndims = int(self.hidden_size_per_attention_head * neox_args.rotary_pct)
        self.rotary_emb = RotaryEmbedding(
            self.rotary_ndims, neox_args.max_position_embeddings, base=neox_args.rotary_emb_base
        )
        self.query_key_value = nn.Linear(neox_args.hidden_size, 3 * neox_args.hidden_size)
        self.dense = nn.Linear(neox_args.hidden_size, neox_args.hidden_size)

    def attention(self, query_layer, key_layer, value_layer, attention_mask):
        sq, b, np_, hn = query_layer.shape
        sk = key_layer.shape[0]
        query_layer = query_layer.reshape(sq, b * np_, hn)
        key_layer = key_layer.reshape(sk, b * np_, hn)
        matmul_result = torch.empty(
            b * np_, sq, sk, dtype=query_layer.dtype, device=query_layer.device
        )
        matmul_result = torch.baddbmm(
            matmul_result,
            query_layer.transpose(0, 1),
            key_layer.transpose(0, 1).transpose(1, 2),
            beta=0.0,
            alpha=(1.0 / self.norm_factor),
        )
        attention_scores = matmul_result.view(b, np_, sq, sk)
        attention_scores = attention_scores.masked_fill(
            attention_mask, torch.finfo(attention_scores.dtype).min
        )
        attention_probs = F.softmax(attention_scores, dim=-1)
        value_layer = value_layer.reshape(sk, b * np_, hn)
        context_layer = torch.bmm(
            attention_probs.view(b * np_, sq, sk), value_layer.transpose(0, 1)
        )
        return context_layer.view(b, np_, sq, hn)

    def forward(self, hidden_states, attention_mask):
        # hidden_states: [sq, b, h]
        mixed_x_layer = self.query_key_value(hidden_states)
        new_shape = mixed_x_layer.size()[:-1] + (
            self.num_attention_heads_per_partition,
            3 * self.hidden_size_per_attention_head,
        )
        mixed_x_layer = mixed_x_layer.view(*new_shape)
        hn = self.hidden_size_per_attention_head
        query_layer, key_layer, value_layer = (
            mixed_x_layer[..., :hn],
            mixed_x_layer[..., hn : 2 * hn],
            mixed_x_layer[..., 2 * hn :],
        )
        query_rot, query_pass = (
            query_layer[..., : self.rotary_ndims],
            query_layer[..., self.rotary_ndims :],
        )
        key_rot, key_pass = key_layer[..., : self.rotary_ndims], key_layer[..., self.rotary_ndims :]
        sq, sk = query_layer.shape[0], key_layer.shape[0]
        if self.use_flash_attention:
            cos, sin = self.rotary_emb(value_layer, seq_len=sk + sq)
            cos_q, sin_q = cos[-sq:], sin[-sq:]  # SLIP
            cos_k, sin_k = cos[:sk], sin[:sk]
            query_layer = (query_rot * cos_q) + (rotate_half(query_rot) * sin_q)
            key_layer = (key_rot * cos_k) + (rotate_half(key_rot) * sin_k)
        else:
            cos, sin = self.rotary_emb(value_layer, seq_len=sk)
            query_layer, key_layer = apply_rotary_pos_emb_torch(
                query_rot, key_rot, cos, sin, offset=0
            )
        query_layer = torch.cat((query_layer, query_pass), dim=-1)
        key_layer = torch.cat((key_layer, key_pass), dim=-1)
        context_layer = self.attention(query_layer, key_layer, value_layer, attention_mask)
        # [b, np, sq, hn] -> [sq, b, hp]
        context_layer = context_layer.permute(2, 0, 1, 3).contiguous()
        context_layer = context_layer.view(sq, -1, self.hidden_size_per_partition)
        return self.dense(context_layer)


class ParallelMLP(nn.Module):
    def __init__(self, neox_args):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(neox_args.hidden_size, 2 * neox_args.hidden_size)
        self.dense_4h_to_h = nn.Linear(2 * neox_args.hidden_size, neox_args.hidden_size)

    def forward(self, x):
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x)))


class ParallelTransformerLayer(nn.Module):
    def __init__(self, neox_args, layer_number):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(neox_args.hidden_size, eps=neox_args.layernorm_epsilon)
        self.post_attention_layernorm = nn.LayerNorm(
            neox_args.hidden_size, eps=neox_args.layernorm_epsilon
        )
        self.attention = ParallelSelfAttention(neox_args, layer_number)
        self.mlp = ParallelMLP(neox_args)

    def forward(self, x, attention_mask):
        # gpt_j_residual: x + attn(ln1(x)) + mlp(ln2(x))
        attention_output = self.attention(self.input_layernorm(x), attention_mask)
        mlp_output = self.mlp(self.post_attention_layernorm(x))
        return x + attention_output + mlp_output


class GPTNeoXLM(nn.Module):
    def __init__(self, neox_args):
        super().__init__()
        self.word_embeddings = nn.Embedding(neox_args.padded_vocab_size, neox_args.hidden_size)
        self.layers = nn.ModuleList(
            [ParallelTransformerLayer(neox_args, i) for i in range(neox_args.num_layers)]
        )
        self.final_norm = nn.LayerNorm(neox_args.hidden_size, eps=neox_args.layernorm_epsilon)

    def forward(self, input_ids):
        b, s = input_ids.shape
        hidden_states = self.word_embeddings(input_ids).transpose(0, 1).contiguous()  # [s, b, h]
        # megatron convention: True = masked
        attention_mask = torch.triu(
            torch.ones(s, s, dtype=torch.bool, device=input_ids.device), diagonal=1
        )[None, None]
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask)
        hidden_states = self.final_norm(hidden_states)
        logits = F.linear(hidden_states, self.word_embeddings.weight)
        return logits.transpose(0, 1).contiguous()


def make_model():
    torch.manual_seed(10)
    model = GPTNeoXLM(NeoXArgs())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn_like(m.weight))
                m.bias.copy_(0.05 * torch.randn_like(m.bias))
    return model.eval()

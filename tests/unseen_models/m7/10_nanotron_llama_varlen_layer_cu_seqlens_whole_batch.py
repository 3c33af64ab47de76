"""nanotron's Llama (src/nanotron/models/llama.py) at toy size, single rank, no pipeline.

Module tree kept from nanotron: model.token_position_embeddings.pp_block.token_embedding,
model.decoder.N.pp_block (LlamaDecoderLayer: input_layernorm, attn, post_attention_layernorm, mlp
with gate_up_proj / down_proj), model.final_layer_norm.pp_block, model.lm_head.pp_block.
Hidden states travel sequence-first [seq, batch, hidden] with a sequence_mask [batch, seq].
CausalSelfAttention: fused qkv_proj (q | k | v), GQA 4/2, interleaved rotary (nanotron's
RotaryEmbedding pairs (2i, 2i+1), theta 10000), then the tokens are packed to
[batch*seq, heads, hd] and CoreAttention runs a varlen causal attention over segments given by
cu_seqlens built from sequence_mask (a torch stand-in for flash_attn_varlen_func), o_proj.
Slip: layer 2's CoreAttention is the "packed" variant whose cu_seqlens is [0, total]: the whole
flattened batch is one causal segment, so the second sequence attends to the first's tokens.
No cache.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": [
        "model.decoder.0.pp_block.attn",
        "model.decoder.1.pp_block.attn",
        "model.decoder.2.pp_block.attn",
    ],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "model.decoder.2.pp_block.attn",
    "stage": "scores",
    "mistake": "batch_mixing",
    "style": "nanotron llama.py: pp_block wrappers, sequence-first hidden states + sequence_mask kwarg, fused qkv_proj GQA 4/2, "
    "interleaved rotary, packed [b*s, h, d] varlen CoreAttention with cu_seqlens; slip: layer 2 uses cu_seqlens [0, b*s]",
}


class LlamaConfig:
    vocab_size = 128
    hidden_size = 64
    intermediate_size = 160
    num_hidden_layers = 3
    num_attention_heads = 4
    num_key_value_heads = 2
    rms_norm_eps = 1e-6
    rope_theta = 10000.0
    max_position_embeddings = 64
    packed_core_attention_layers = (2,)


class PipelineBlock(nn.Module):
    def __init__(self, module):
        super().__init__()
        self.pp_block = module

    def forward(self, *args, **kwargs):
        return self.pp_block(*args, **kwargs)


class TritonRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x):
        var = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(var + self.eps) * self.weight


class RotaryEmbedding(nn.Module):
    """interleaved: pairs (x[2i], x[2i+1]) rotated by position * theta^(-2i/d)"""

    def __init__(self, dim, end, theta=10000.0):
        super().__init__()
        self.dim = dim
        freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64)[: dim // 2] / dim))
        t = torch.arange(end, dtype=torch.float64)
        angles = torch.outer(t, freqs)
        self.register_buffer("cos_cached", angles.cos().float(), persistent=False)
        self.register_buffer("sin_cached", angles.sin().float(), persistent=False)

    def forward(self, x, position_ids):
        # x: [batch, seq, heads, dim]; position_ids: [batch, seq]
        cos = self.cos_cached[position_ids].to(x.dtype)[:, :, None, :]
        sin = self.sin_cached[position_ids].to(x.dtype)[:, :, None, :]
        x_even = x[..., 0::2]
        x_odd = x[..., 1::2]
        out_even = x_even * cos - x_odd * sin
        out_odd = x_even * sin + x_odd * cos
        return torch.stack([out_even, out_odd], dim=-1).flatten(-2)


def varlen_causal_attention(q, k, v, cu_seqlens, softmax_scale):
    # q: [total, nq, d], k/v: [total, nkv, d]
    n_rep = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    for i in range(cu_seqlens.numel() - 1):
        s, e = int(cu_seqlens[i]), int(cu_seqlens[i + 1])
        qs = q[s:e].transpose(0, 1)
        ks = k[s:e].repeat_interleave(n_rep, dim=1).transpose(0, 1)
        vs = v[s:e].repeat_interleave(n_rep, dim=1).transpose(0, 1)
        scores = torch.matmul(qs, ks.transpose(-1, -2)) * softmax_scale
        L = e - s
        causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        out[s:e] = torch.matmul(torch.softmax(scores, dim=-1), vs).transpose(0, 1)
    return out


class CoreAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.d_qk = config.hidden_size // config.num_attention_heads

    def cu_seqlens_from_mask(self, sequence_mask):
        lengths = sequence_mask.sum(-1, dtype=torch.int32)
        return F.pad(torch.cumsum(lengths, dim=0, dtype=torch.int32), (1, 0))

    def forward(self, query_states, key_states, value_states, q_sequence_mask, kv_sequence_mask):
        cu_seqlens = self.cu_seqlens_from_mask(q_sequence_mask)
        return varlen_causal_attention(
            query_states, key_states, value_states, cu_seqlens, softmax_scale=self.d_qk**-0.5
        )


class PackedCoreAttention(CoreAttention):
    def cu_seqlens_from_mask(self, sequence_mask):
        total = int(sequence_mask.sum())
        return torch.tensor([0, total], dtype=torch.int32, device=sequence_mask.device)


class CausalSelfAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.n_local_q_heads = config.num_attention_heads
        self.n_local_kv_heads = config.num_key_value_heads
        self.d_qk = config.hidden_size // config.num_attention_heads
        self.d_v = self.d_qk
        self.d_model = config.hidden_size
        self.qkv_proj = nn.Linear(
            self.d_model, (self.n_local_q_heads + 2 * self.n_local_kv_heads) * self.d_qk, bias=False
        )
        self.rotary_embedding = RotaryEmbedding(
            self.d_qk, config.max_position_embeddings, config.rope_theta
        )
        self.o_proj = nn.Linear(self.n_local_q_heads * self.d_v, self.d_model, bias=False)
        core_cls = (
            PackedCoreAttention
            if layer_idx in config.packed_core_attention_layers
            else CoreAttention
        )
        self.attention = core_cls(config)

    def forward(self, hidden_states, sequence_mask):
        qkv_states = self.qkv_proj(hidden_states)  # [seq, batch, ...]
        q_length, batch_size, _ = qkv_states.shape
        q_size = self.n_local_q_heads * self.d_qk
        kv_size = self.n_local_kv_heads * self.d_qk
        query_states, key_states, value_states = torch.split(
            qkv_states, [q_size, kv_size, kv_size], dim=-1
        )
        query_states = (
            query_states.transpose(0, 1)
            .contiguous()
            .view(batch_size, q_length, self.n_local_q_heads, self.d_qk)
        )
        key_states = (
            key_states.transpose(0, 1)
            .contiguous()
            .view(batch_size, q_length, self.n_local_kv_heads, self.d_qk)
        )
        value_states = (
            value_states.transpose(0, 1)
            .contiguous()
            .view(batch_size, q_length, self.n_local_kv_heads, self.d_v)
        )
        position_ids = torch.cumsum(sequence_mask, dim=-1, dtype=torch.int32) - 1
        query_states = self.rotary_embedding(query_states, position_ids=position_ids)
        key_states = self.rotary_embedding(key_states, position_ids=position_ids)
        flat = sequence_mask.reshape(-1)
        query_states = query_states.reshape(batch_size * q_length, self.n_local_q_heads, self.d_qk)[
            flat
        ]
        key_states = key_states.reshape(batch_size * q_length, self.n_local_kv_heads, self.d_qk)[
            flat
        ]
        value_states = value_states.reshape(batch_size * q_length, self.n_local_kv_heads, self.d_v)[
            flat
        ]
        attention_output = self.attention(
            query_states, key_states, value_states, sequence_mask, sequence_mask
        )
        full = attention_output.new_zeros(batch_size * q_length, self.n_local_q_heads, self.d_v)
        full[flat] = attention_output
        attention_output = full.view(
            batch_size, q_length, self.n_local_q_heads * self.d_v
        ).transpose(0, 1)
        return self.o_proj(attention_output)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, hidden_states):
        gate, up = self.gate_up_proj(hidden_states).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.input_layernorm = TritonRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attn = CausalSelfAttention(config, layer_idx)
        self.post_attention_layernorm = TritonRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, hidden_states, sequence_mask):
        residual = hidden_states
        hidden_states = (
            self.attn(self.input_layernorm(hidden_states), sequence_mask=sequence_mask) + residual
        )
        residual = hidden_states
        hidden_states = self.mlp(self.post_attention_layernorm(hidden_states)) + residual
        return {"hidden_states": hidden_states, "sequence_mask": sequence_mask}


class Embedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.token_embedding = nn.Embedding(config.vocab_size, config.hidden_size)

    def forward(self, input_ids, input_mask):
        input_ids = input_ids.transpose(0, 1)
        return {"input_embeds": self.token_embedding(input_ids)}


class LlamaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.token_position_embeddings = PipelineBlock(Embedding(config))
        self.decoder = nn.ModuleList(
            [PipelineBlock(LlamaDecoderLayer(config, i)) for i in range(config.num_hidden_layers)]
        )
        self.final_layer_norm = PipelineBlock(
            TritonRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        )
        self.lm_head = PipelineBlock(nn.Linear(config.hidden_size, config.vocab_size, bias=False))

    def forward(self, input_ids, input_mask=None):
        if input_mask is None:
            input_mask = torch.ones_like(input_ids, dtype=torch.bool)
        output = self.token_position_embeddings(input_ids=input_ids, input_mask=input_mask)
        state = {"hidden_states": output["input_embeds"], "sequence_mask": input_mask.bool()}
        for block in self.decoder:
            state = block(**state)
        hidden_states = self.final_layer_norm(state["hidden_states"])
        return self.lm_head(hidden_states).transpose(0, 1)


class LlamaForTraining(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = LlamaModel(config)

    def forward(self, input_ids, input_mask=None):
        return self.model(input_ids, input_mask)


def make_model():
    torch.manual_seed(710)
    model = LlamaForTraining(LlamaConfig())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Linear):
                m.weight.normal_(0.0, 0.1)
            elif isinstance(m, nn.Embedding):
                m.weight.normal_(0.0, 0.5)
            elif isinstance(m, TritonRMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn_like(m.weight))
    return model.eval()

"""optimum-habana's GaudiLlamaForCausalLM (optimum/habana/transformers/models/llama/modeling_llama.py)
without HPU kernels.

HF Llama names: model.embed_tokens, model.layers.N (input_layernorm, self_attn, post_attention_layernorm,
mlp), model.norm, lm_head.  GaudiLlamaAttention: q_proj/k_proj/v_proj/o_proj (no bias), rotate_half
rotary (base 1e4) gathered by position_ids, then gaudi_llama_repeat_kv: instead of repeating keys and
values it reshapes the *queries* to (b, kv_heads, n_rep, q_len, d) and gives keys/values a singleton
group axis (b, kv_heads, 1, kv_len, d), so query head h meets kv head h // n_rep; Matmul modules
(matmul_qk, matmul_av) do the products, scores * norm_factor (1/sqrt(d)), finfo.min mask unsqueezed
on the group axis, float32 softmax, and the result is reshaped back to (b, heads, q_len, d).  GQA 4/2.
Slip: layer 1 is a `GaudiLlamaAttention` built with `fused_group_layout="rep_major"` (a layout switch
meant for a fused kernel that wants (b, n_rep, kv, ...)): its queries are reshaped to
(b, n_rep, kv_heads, q, d) and transposed to (b, kv_heads, n_rep, q, d), so query head h meets kv head
h % kv_heads.  The output reshape follows the same layout, so only the pairing is wrong.
No cache is used: `model(ids)` returns an object with `.logits`.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["model.layers.0.self_attn", "model.layers.1.self_attn", "model.layers.2.self_attn"],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "model.layers.1.self_attn",
    "stage": "scores",
    "mistake": "kv_group_mapping",
    "style": "optimum-habana GaudiLlama: gaudi_llama_repeat_kv reshapes queries into (b, kv, n_rep, q, d) groups "
    "instead of repeating kv, Matmul modules matmul_qk/matmul_av, norm_factor, rotate_half base 1e4, GQA 4/2; "
    "layer 1's rep_major layout groups query heads as h % kv_heads",
}


class Matmul(nn.Module):
    def forward(self, x, y):
        return torch.matmul(x, y)


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.variance_epsilon))


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rotary_tables(head_dim, position_ids, base, dtype):
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    freqs = position_ids[..., None].to(torch.float64) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def gaudi_llama_repeat_kv(query_states, key_states, value_states, attention_mask, n_rep, rep_major=False):
    batch, num_key_value_heads, kv_len, head_dim = key_states.shape
    if n_rep == 1 or num_key_value_heads == 1:
        return query_states, key_states, value_states, attention_mask
    new_kv_shape = (batch, num_key_value_heads, 1, kv_len, head_dim)
    key_states = key_states.reshape(new_kv_shape)
    value_states = value_states.reshape(new_kv_shape)
    batch, _, q_len, head_dim = query_states.shape
    if rep_major:
        query_states = query_states.reshape(batch, n_rep, num_key_value_heads, q_len, head_dim).transpose(1, 2)
    else:
        query_states = query_states.reshape(batch, num_key_value_heads, n_rep, q_len, head_dim)
    if attention_mask is not None:
        attention_mask = attention_mask.unsqueeze(1)
    return query_states, key_states, value_states, attention_mask


class GaudiLlamaAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.rope_theta = config.rope_theta
        self.rep_major = config.fused_group_layout[layer_idx] == "rep_major"
        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=False)
        self.matmul_qk = Matmul()
        self.matmul_av = Matmul()
        self.norm_factor = 1.0 / math.sqrt(self.head_dim)

    def forward(self, hidden_states, attention_mask, position_ids):
        bsz, q_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        cos, sin = rotary_tables(self.head_dim, position_ids, self.rope_theta, hidden_states.dtype)
        query_states = query_states * cos + rotate_half(query_states) * sin
        key_states = key_states * cos + rotate_half(key_states) * sin
        query_states, key_states, value_states, attention_mask = gaudi_llama_repeat_kv(
            query_states, key_states, value_states, attention_mask, self.num_key_value_groups, self.rep_major
        )
        attn_weights = self.matmul_qk(query_states, key_states.transpose(-2, -1)) * self.norm_factor
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        sm_dtype = torch.float64 if attn_weights.dtype == torch.float64 else torch.float32
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=sm_dtype).to(query_states.dtype)
        attn_output = self.matmul_av(attn_weights, value_states)
        if self.rep_major:
            attn_output = attn_output.transpose(1, 2)
        attn_output = attn_output.reshape(bsz, -1, q_len, self.head_dim)
        attn_output = attn_output.transpose(1, 2).contiguous().reshape(bsz, q_len, self.hidden_size)
        return self.o_proj(attn_output), None


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GaudiLlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = GaudiLlamaAttention(config, layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask, position_ids):
        residual = hidden_states
        hidden_states, _ = self.self_attn(self.input_layernorm(hidden_states), attention_mask, position_ids)
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class GaudiLlamaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([GaudiLlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids):
        bsz, seq_len = input_ids.shape
        hidden_states = self.embed_tokens(input_ids)
        dtype = hidden_states.dtype
        position_ids = torch.arange(seq_len, device=input_ids.device)[None].expand(bsz, -1)
        mask = torch.full((seq_len, seq_len), torch.finfo(dtype).min, dtype=dtype).triu(1)
        mask = mask[None, None].expand(bsz, 1, seq_len, seq_len)
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(hidden_states, mask, position_ids)
        return self.norm(hidden_states)


class GaudiLlamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = GaudiLlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids):
        return SimpleNamespace(logits=self.lm_head(self.model(input_ids)))


def make_model():
    torch.manual_seed(1709)
    config = SimpleNamespace(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        fused_group_layout=["kv_major", "rep_major", "kv_major"],
    )
    model = GaudiLlamaForCausalLM(config)
    g = torch.Generator().manual_seed(17091)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LlamaRMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

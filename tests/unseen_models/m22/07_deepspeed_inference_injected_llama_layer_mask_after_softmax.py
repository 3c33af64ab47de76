"""microsoft/DeepSpeed inference v1 kernel injection for a Llama model (deepspeed/ops/transformer/inference:
DeepSpeedTransformerInference, DeepSpeedSelfAttention, DeepSpeedMLP), with the CUDA ops written out in torch.

After injection every `model.layers.N` is a DeepSpeedGPTInference-style container holding raw
parameters in DeepSpeed's names: `norm_w` (input RMSNorm), `attention` (DeepSpeedSelfAttention with a
fused `attn_qkvw` (3*hidden, hidden) and `attn_ow`, no biases) and `mlp` (DeepSpeedMLP with `attn_nw`
(the post-attention RMSNorm, which DeepSpeed keeps in the MLP), `inter_up_w`, `inter_gate_w`,
`output_w`).  `qkv_gemm` then `linear_func` reshape to (b, s, 3, heads, d); the rotary op
(`rotate_half=True`, rotary_dim = head_dim, theta 1e4) rotates q and k; `softmax_context` scales the
query by 1/sqrt(d) (norm_factor), applies the triangular mask with DeepSpeed's -10000 fill, softmax,
and multiplies with v; `vector_matmul` with `attn_ow`.
Slip: layer 2 was injected with `triangular_masking=False` (the config of an encoder policy), and the
injected layer falls back to masking the *probabilities* instead: softmax over all keys, then
multiplied by the lower-triangular 0/1 mask, with no renormalisation.  Layers 0, 1 and 3 are exact.
No cache.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": [
        "model.layers.0.attention",
        "model.layers.1.attention",
        "model.layers.2.attention",
        "model.layers.3.attention",
    ],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "model.layers.2.attention",
    "stage": "weights",
    "mistake": "mask_after_softmax",
    "style": "DeepSpeed inference injection (Llama policy): raw attn_qkvw/attn_ow, norm_w, mlp.attn_nw, rotate_half "
    "rotary op, softmax_context with -10000 triangular fill; layer 2 injected with triangular_masking=False "
    "masks the probabilities after the softmax",
}


def rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rotary_pos_emb(q, k, rotary_dim, offset, base):
    # q, k: (b, s, h, d)
    seq = q.shape[1]
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    t = torch.arange(offset, offset + seq, dtype=torch.float64)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    cos = emb.cos().to(q.dtype)[None, :, None, :]
    sin = emb.sin().to(q.dtype)[None, :, None, :]
    q_rot = q[..., :rotary_dim] * cos + rotate_half(q[..., :rotary_dim]) * sin
    k_rot = k[..., :rotary_dim] * cos + rotate_half(k[..., :rotary_dim]) * sin
    return torch.cat([q_rot, q[..., rotary_dim:]], -1), torch.cat([k_rot, k[..., rotary_dim:]], -1)


def softmax_context(query, key, value, norm_factor, triangular_masking):
    # (b, h, s, d)
    scores = torch.matmul(query * norm_factor, key.transpose(-1, -2))
    s_q, s_k = scores.shape[-2], scores.shape[-1]
    tril = torch.ones(s_q, s_k, dtype=torch.bool, device=scores.device).tril(diagonal=s_k - s_q)
    if triangular_masking:
        scores = scores.masked_fill(~tril, -10000.0)
        probs = F.softmax(scores, dim=-1)
    else:
        probs = F.softmax(scores, dim=-1)
        probs = probs * tril.to(probs.dtype)
    return torch.matmul(probs, value)


class DeepSpeedSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.num_attention_heads_per_partition = config.heads
        self.hidden_size_per_attention_head = hidden // config.heads
        self.attn_qkvw = nn.Parameter(torch.randn(3 * hidden, hidden) / math.sqrt(hidden))
        self.attn_qkvb = None
        self.attn_ow = nn.Parameter(torch.randn(hidden, hidden) / math.sqrt(hidden))
        self.attn_ob = None
        self.norm_factor = 1.0 / math.sqrt(self.hidden_size_per_attention_head)

    def qkv_gemm(self, x):
        return F.linear(x, self.attn_qkvw, self.attn_qkvb)

    def forward(self, input):
        b, s, _ = input.shape
        h, d = self.num_attention_heads_per_partition, self.hidden_size_per_attention_head
        qkv_out = self.qkv_gemm(input).view(b, s, 3, h, d)
        query, key, value = qkv_out.unbind(dim=2)
        query, key = apply_rotary_pos_emb(query, key, self.config.rotary_dim, 0, self.config.rope_theta)
        context_layer = softmax_context(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
            self.norm_factor, self.config.triangular_masking,
        )
        context_layer = context_layer.transpose(1, 2).reshape(b, s, h * d)
        return F.linear(context_layer, self.attn_ow, self.attn_ob)


class DeepSpeedMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        hidden, inter = config.hidden_size, config.intermediate_size
        self.attn_nw = nn.Parameter(torch.ones(hidden))
        self.inter_up_w = nn.Parameter(torch.randn(inter, hidden) / math.sqrt(hidden))
        self.inter_gate_w = nn.Parameter(torch.randn(inter, hidden) / math.sqrt(hidden))
        self.output_w = nn.Parameter(torch.randn(hidden, inter) / math.sqrt(inter))

    def forward(self, input, residual):
        x = rms_norm(input, self.attn_nw, self.config.epsilon)
        x = F.silu(F.linear(x, self.inter_gate_w)) * F.linear(x, self.inter_up_w)
        return residual + F.linear(x, self.output_w)


class DeepSpeedGPTInference(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.norm_w = nn.Parameter(torch.ones(config.hidden_size))
        self.attention = DeepSpeedSelfAttention(config)
        self.mlp = DeepSpeedMLP(config)

    def forward(self, input):
        input_norm = rms_norm(input, self.norm_w, self.config.epsilon)
        attention_output = self.attention(input_norm)
        residual = input + attention_output
        return self.mlp(residual, residual)


class InjectedLlamaModel(nn.Module):
    def __init__(self, configs, vocab_size, hidden):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, hidden)
        self.layers = nn.ModuleList([DeepSpeedGPTInference(c) for c in configs])
        self.norm_weight = nn.Parameter(torch.ones(hidden))


class InjectedLlamaForCausalLM(nn.Module):
    def __init__(self, configs, vocab_size, hidden):
        super().__init__()
        self.model = InjectedLlamaModel(configs, vocab_size, hidden)
        self.lm_head = nn.Linear(hidden, vocab_size, bias=False)

    def forward(self, input_ids):
        h = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            h = layer(h)
        return self.lm_head(rms_norm(h, self.model.norm_weight, 1e-6))



def make_model():
    torch.manual_seed(2207)
    configs = [
        SimpleNamespace(
            hidden_size=64, heads=4, intermediate_size=160, rotary_dim=16, rope_theta=10000.0,
            epsilon=1e-6, triangular_masking=(i != 2),
        )
        for i in range(4)
    ]
    model = InjectedLlamaForCausalLM(configs, 96, 64)
    g = torch.Generator().manual_seed(22071)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.norm_w.copy_(1.0 + 0.3 * torch.randn(64, generator=g))
            layer.mlp.attn_nw.copy_(1.0 + 0.3 * torch.randn(64, generator=g))
        model.model.norm_weight.copy_(1.0 + 0.3 * torch.randn(64, generator=g))
    return model.eval()

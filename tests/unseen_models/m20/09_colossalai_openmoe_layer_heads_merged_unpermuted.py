"""OpenMoE (XueFuzhao/OpenMoE, the ColossalAI PyTorch modeling_openmoe.py) in plain torch.

OpenMoeForCausalLM: `model.embed_tokens`, `model.layers.N` (OpenMoeDecoderLayer: `input_layernorm`,
`self_attn`, `post_attention_layernorm`, then a dense `mlp` or, every `moe_layer_interval` layers, a
`mlp` that is a top-2 softmax-routed SparseMLP with `extra_mlp` on the side), `model.norm`, `lm_head`.
OpenMoeAttention keeps T5X's habit of a head_dim that is not hidden/heads: 4 heads of 24 (96 != 64);
q/k/v/o without bias, rotary in the T5X layout (rotate-half tables, base 1e4, applied to the whole head),
eager matmul / sqrt(head_dim), additive finfo.min causal mask, softmax in float32.
Slip: layer 2 takes the `pretraining_tp`-style merge branch that reshapes the (b, h, t, d) context
straight to (b, t, h*d) without moving the head axis back, mixing tokens and heads before `o_proj`.
No cache.
"""

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
    "layer": "model.layers.2.self_attn",
    "stage": "output",
    "mistake": "heads_merge",
    "style": "OpenMoE (ColossalAI modeling_openmoe.py): head_dim 24 x 4 heads != hidden 64, rotate-half rotary base 1e4, "
    "top-2 SparseMLP + extra_mlp every 2nd layer; layer 2 reshapes (b, h, t, d) to (b, t, h*d) without transposing",
}


class OpenMoeRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class OpenMoeAttention(nn.Module):
    def __init__(self, config, merge_without_transpose=False):
        super().__init__()
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.rope_theta = config.rope_theta
        self.merge_without_transpose = merge_without_transpose
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask):
        bsz, q_len, _ = hidden_states.size()
        q = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        inv = 1.0 / (self.rope_theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim))
        freqs = torch.arange(q_len, dtype=torch.float64)[:, None] * inv[None]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        attn_weights = torch.matmul(q, k.transpose(2, 3)) / (self.head_dim**0.5)
        attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(q.dtype) if q.dtype != torch.float64 \
            else F.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, v)
        if self.merge_without_transpose:
            attn_output = attn_output.reshape(bsz, q_len, self.num_heads * self.head_dim)
        else:
            attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, self.num_heads * self.head_dim)
        return self.o_proj(attn_output)


class OpenMoeMLP(nn.Module):
    def __init__(self, hidden, inter):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class SparseMLP(nn.Module):
    def __init__(self, hidden, inter, num_experts, topk):
        super().__init__()
        self.topk = topk
        self.gate_weight = nn.Parameter(torch.randn(num_experts, hidden) / hidden**0.5)
        self.experts = nn.ModuleList([OpenMoeMLP(hidden, inter) for _ in range(num_experts)])

    def forward(self, x):
        logits = x @ self.gate_weight.t()
        probs = logits.softmax(-1)
        w, idx = probs.topk(self.topk, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            sel = (idx == e).to(x.dtype) * w
            out = out + expert(x) * sel.sum(-1, keepdim=True)
        return out


class OpenMoeDecoderLayer(nn.Module):
    def __init__(self, config, moe, merge_without_transpose):
        super().__init__()
        self.moe = moe
        self.input_layernorm = OpenMoeRMSNorm(config.hidden_size)
        self.self_attn = OpenMoeAttention(config, merge_without_transpose)
        self.post_attention_layernorm = OpenMoeRMSNorm(config.hidden_size)
        if moe:
            self.mlp = SparseMLP(config.hidden_size, config.intermediate_size, config.num_experts, 2)
            self.pre_extra_mlp_layernorm = OpenMoeRMSNorm(config.hidden_size)
            self.extra_mlp = OpenMoeMLP(config.hidden_size, config.intermediate_size)
        else:
            self.mlp = OpenMoeMLP(config.hidden_size, config.intermediate_size)

    def forward(self, h, mask):
        h = h + self.self_attn(self.input_layernorm(h), mask)
        if self.moe:
            h = h + self.extra_mlp(self.pre_extra_mlp_layernorm(h))
        return h + self.mlp(self.post_attention_layernorm(h))


class OpenMoeModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([
            OpenMoeDecoderLayer(config, (i + 1) % config.moe_layer_interval == 0, i in config.tp_merge_layers)
            for i in range(config.num_hidden_layers)
        ])
        self.norm = OpenMoeRMSNorm(config.hidden_size)


class OpenMoeForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = OpenMoeModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids):
        b, t = input_ids.shape
        h = self.model.embed_tokens(input_ids)
        mask = torch.full((t, t), torch.finfo(h.dtype).min, dtype=h.dtype, device=h.device).triu(1)[None, None]
        for layer in self.model.layers:
            h = layer(h, mask)
        return self.lm_head(self.model.norm(h))


def make_model():
    torch.manual_seed(2009)
    config = SimpleNamespace(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                             num_attention_heads=4, head_dim=24, rope_theta=10000.0, num_experts=4,
                             moe_layer_interval=2, tp_merge_layers=(2,))
    model = OpenMoeForCausalLM(config)
    g = torch.Generator().manual_seed(20091)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, OpenMoeRMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

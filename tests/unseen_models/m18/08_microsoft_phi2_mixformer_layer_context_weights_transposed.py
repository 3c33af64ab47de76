"""microsoft/phi-2 first remote code (modeling_phi.py, the MixFormer lineage, before the transformers port).

PhiForCausalLM: `transformer` (PhiModel: `embd` (Embedding wrapper holding `wte`), `h.N` ParallelBlock)
and `lm_head` (CausalLMHead: `ln`, `linear` with bias).  ParallelBlock: one `ln`, then
`mixer(ln(x)) + mlp(ln(x)) + x` (MLP fc1 / fc2, gelu_new).  MHA (`transformer.h.N.mixer`) holds the fused
`Wqkv` (bias) and `out_proj`, a partial `rotary_emb` (rotary_dim 8 of head 16, halves of the rotated
part, base 1e4, float64 cos/sin cache cast at use, offset `seqlen_offset`) and an `inner_attn`
SelfAttention (no weights): q, k, v = qkv.unbind(2); scores = einsum("bthd,bshd->bhts", q, k * scale);
additive triu(-10000) causal mask; softmax in float; output = einsum("bhts,bshd->bthd", attn, v).
MHA 4 x 16.
Slip: block 1's mixer uses the `inner_attn` of a SelfAttention subclass from an experimental
"reverse" kernel port whose final einsum reads "bhst,bshd->bthd": the attention weights are contracted
over the query axis instead of the key axis.  No cache.  Returns the logits tensor.
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
        "transformer.h.0.mixer",
        "transformer.h.1.mixer",
        "transformer.h.2.mixer",
    ],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "transformer.h.1.mixer",
    "stage": "context",
    "mistake": "context_wrong_product",
    "style": "phi-2 MixFormer modeling_phi.py: embd.wte, ParallelBlock (one ln, mixer + mlp), MHA mixer with fused Wqkv "
    "(b, s, 3, h, d), partial rotary 8/16 halves, weightless inner_attn SelfAttention (k pre-scaled, -10000 triu), "
    "CausalLMHead ln/linear; block 1's inner_attn contracts weights over the query axis ('bhst,bshd->bthd')",
}


class Embedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)

    def forward(self, input_ids):
        return self.wte(input_ids.view(-1, input_ids.size(-1)))


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, base=10000, max_position_embeddings=64):
        super().__init__()
        self.dim = dim
        self.base = float(base)
        self.max_position_embeddings = max_position_embeddings
        inv_freq = 1.0 / (self.base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        t = torch.arange(max_position_embeddings, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)
        self.register_buffer("cos_cached", torch.cos(freqs), persistent=False)
        self.register_buffer("sin_cached", torch.sin(freqs), persistent=False)

    @staticmethod
    def _apply_rotary_emb_qkv(qkv, cos, sin):
        _, seqlen, three, _, headdim = qkv.shape
        rotary_seqlen, rotary_dim = cos.shape
        rotary_dim *= 2
        q_rot = qkv[:, :, 0, :, :rotary_dim]
        q_pass = qkv[:, :, 0, :, rotary_dim:]
        k_rot = qkv[:, :, 1, :, :rotary_dim]
        k_pass = qkv[:, :, 1, :, rotary_dim:]
        q1, q2 = q_rot.chunk(2, dim=-1)
        k1, k2 = k_rot.chunk(2, dim=-1)
        c = cos[:seqlen].unsqueeze(1).to(qkv.dtype)
        s = sin[:seqlen].unsqueeze(1).to(qkv.dtype)
        q_rot = torch.cat([q1 * c - q2 * s, q1 * s + q2 * c], dim=-1)
        k_rot = torch.cat([k1 * c - k2 * s, k1 * s + k2 * c], dim=-1)
        return torch.cat(
            [
                torch.cat([q_rot, q_pass], dim=-1).unsqueeze(2),
                torch.cat([k_rot, k_pass], dim=-1).unsqueeze(2),
                qkv[:, :, 2:3, :, :],
            ],
            dim=2,
        )

    def forward(self, qkv, seqlen_offset=0):
        return self._apply_rotary_emb_qkv(
            qkv, self.cos_cached[seqlen_offset:].double(), self.sin_cached[seqlen_offset:].double()
        )


class SelfAttention(nn.Module):
    def __init__(self, causal=True, softmax_scale=None):
        super().__init__()
        self.causal = causal
        self.softmax_scale = softmax_scale

    def _combine(self, attention, v):
        return torch.einsum("bhts,bshd->bthd", attention, v)

    def forward(self, qkv, causal=None):
        batch_size, seqlen = qkv.shape[0], qkv.shape[1]
        q, k, v = qkv.unbind(dim=2)
        softmax_scale = self.softmax_scale or 1.0 / math.sqrt(q.shape[-1])
        scores = torch.einsum("bthd,bshd->bhts", q, k * softmax_scale)
        causal = self.causal if causal is None else causal
        if causal:
            causal_mask = torch.triu(torch.full((seqlen, seqlen), -10000.0, device=scores.device), 1)
            scores = scores + causal_mask.to(dtype=scores.dtype)
        attention = torch.softmax(scores, dim=-1).to(v.dtype)
        return self._combine(attention, v)


class ReverseKernelSelfAttention(SelfAttention):
    def _combine(self, attention, v):
        return torch.einsum("bhst,bshd->bthd", attention, v)


INNER_ATTN = {"eager": SelfAttention, "reverse_kernel": ReverseKernelSelfAttention}


class MHA(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.rotary_emb = RotaryEmbedding(config.rotary_dim, max_position_embeddings=config.n_positions)
        self.n_head = config.n_head
        self.head_dim = config.n_embd // config.n_head
        op_size = self.head_dim * 3 * self.n_head
        self.Wqkv = nn.Linear(config.n_embd, op_size)
        self.out_proj = nn.Linear(config.n_embd, config.n_embd)
        self.inner_attn = INNER_ATTN[config.attn_impl_per_layer.get(layer_idx, "eager")](causal=True)
        self.layer_idx = layer_idx

    def forward(self, x, seqlen_offset=0):
        qkv = self.Wqkv(x)
        qkv = qkv.view(qkv.shape[0], qkv.shape[1], 3, self.n_head, self.head_dim)
        qkv = self.rotary_emb(qkv, seqlen_offset=seqlen_offset)
        attn_output = self.inner_attn(qkv)
        output = attn_output.reshape(attn_output.shape[0], attn_output.shape[1], -1)
        return self.out_proj(output)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.fc1 = nn.Linear(config.n_embd, config.n_inner)
        self.fc2 = nn.Linear(config.n_inner, config.n_embd)

    def forward(self, hidden_states):
        return self.fc2(F.gelu(self.fc1(hidden_states), approximate="tanh"))


class ParallelBlock(nn.Module):
    def __init__(self, config, block_idx):
        super().__init__()
        self.ln = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.block_idx = block_idx
        self.mixer = MHA(config, layer_idx=block_idx)
        self.mlp = MLP(config)

    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.ln(hidden_states)
        attn_outputs = self.mixer(hidden_states)
        feed_forward_hidden_states = self.mlp(hidden_states)
        return attn_outputs + feed_forward_hidden_states + residual


class CausalLMHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.linear = nn.Linear(config.n_embd, config.vocab_size)

    def forward(self, hidden_states):
        return self.linear(self.ln(hidden_states))


class PhiModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embd = Embedding(config)
        self.h = nn.ModuleList([ParallelBlock(config, block_idx=i) for i in range(config.n_layer)])

    def forward(self, input_ids):
        hidden_states = self.embd(input_ids)
        for layer in self.h:
            hidden_states = layer(hidden_states)
        return hidden_states


class PhiForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.transformer = PhiModel(config)
        self.lm_head = CausalLMHead(config)

    def forward(self, input_ids):
        return self.lm_head(self.transformer(input_ids))


def make_model():
    torch.manual_seed(1808)
    config = SimpleNamespace(
        vocab_size=96, n_embd=64, n_head=4, n_layer=3, n_inner=128, n_positions=64,
        rotary_dim=8, layer_norm_epsilon=1e-5, attn_impl_per_layer={1: "reverse_kernel"},
    )
    model = PhiForCausalLM(config)
    g = torch.Generator().manual_seed(18081)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model.eval()

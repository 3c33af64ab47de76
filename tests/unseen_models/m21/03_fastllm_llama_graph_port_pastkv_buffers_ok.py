"""ztxz16/fastllm LlamaModel::ForwardBatch (C++) ported op by op to torch.

Weights under the HF names fastllm loads (`model.embed_tokens`, `model.layers.N.self_attn.q_proj` ...,
`model.norm`, `lm_head`), each fastllm op a small function here: RMSNorm, Linear, PermuteSelf,
LlamaRotatePosition2D (rotate-half over the first `rotary_dim` = head_dim features, sin/cos tables
`sinData`/`cosData` built once for 64 positions, theta 1e4, indexed by float positionIds),
CatDirect into per-layer `pastKeyValues` buffers laid out (b*heads, 64, d) with a running length,
MatMulTransB with alpha 1/sqrt(head_dim), AttentionMask (fills -10000 where the mask is 1), Softmax,
MatMul, PermuteSelf back, o_proj.  MHA 4x16.  SwiGLU MLP (gate_proj/up_proj/down_proj).
Cache: book-buffers: `model.reset_kv_cache()`, `model(prompt, use_cache=True)`,
`model(tok, use_cache=True)`; buffers hold batch <= 4 and 64 positions; `model(ids)` touches no cache.
Returns the logits tensor.  Correct.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": [
        "model.layers.0.self_attn",
        "model.layers.1.self_attn",
        "model.layers.2.self_attn",
    ],
    "kind": "causal-multihead",
    "cache": "book-buffers",
    "style": "fastllm LlamaModel graph: PermuteSelf/(b*h) layout, LlamaRotatePosition2D from sinData/cosData "
    "and float positionIds, CatDirect into preallocated pastKeyValues, MatMulTransB alpha, AttentionMask -10000",
}


def RMSNorm(x, weight, eps):
    xf = x.float() if x.dtype != torch.float64 else x
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def PermuteSelf(x, axis):
    return x.permute(*axis).contiguous()


def LlamaRotatePosition2D(data, positionIds, sinData, cosData, rotary_dim):
    # data: (b, s, h, d); positionIds: (b, s) float
    pos = positionIds.long()
    half = rotary_dim // 2
    cos = cosData[pos].to(data.dtype)[:, :, None, :]  # (b, s, 1, half)
    sin = sinData[pos].to(data.dtype)[:, :, None, :]
    x1 = data[..., :half]
    x2 = data[..., half:rotary_dim]
    out = data.clone()
    out[..., :half] = x1 * cos - x2 * sin
    out[..., half:rotary_dim] = x1 * sin + x2 * cos
    return out


def AttentionMask(scores, mask, maskValue):
    return scores.masked_fill(mask.bool(), maskValue)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.num_attention_heads = cfg.num_attention_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.o_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)

    def forward(self, attenInput, positionIds, attentionMask, rot, pastKeyValue=None):
        bsz, seqlen = attenInput.shape[:2]
        h, d = self.num_attention_heads, self.head_dim
        q = self.q_proj(attenInput).reshape(bsz, seqlen, h, d)
        k = self.k_proj(attenInput).reshape(bsz, seqlen, h, d)
        v = self.v_proj(attenInput).reshape(bsz, seqlen, h, d)
        q = LlamaRotatePosition2D(q, positionIds, *rot)
        k = LlamaRotatePosition2D(k, positionIds, *rot)
        q = PermuteSelf(q, (0, 2, 1, 3)).reshape(bsz * h, seqlen, d)
        k = PermuteSelf(k, (0, 2, 1, 3)).reshape(bsz * h, seqlen, d)
        v = PermuteSelf(v, (0, 2, 1, 3)).reshape(bsz * h, seqlen, d)
        if pastKeyValue is not None:
            pastKey, pastValue, state = pastKeyValue
            start = state["len"]
            pastKey[: bsz * h, start : start + seqlen] = k  # CatDirect
            pastValue[: bsz * h, start : start + seqlen] = v
            k = pastKey[: bsz * h, : start + seqlen]
            v = pastValue[: bsz * h, : start + seqlen]
        attenWeights = torch.matmul(q, k.transpose(1, 2)) * (1.0 / math.sqrt(d))  # MatMulTransB alpha
        attenWeights = attenWeights.view(bsz, h, seqlen, -1)
        attenWeights = AttentionMask(attenWeights, attentionMask[:, None], -10000.0)
        attenWeights = F.softmax(attenWeights, dim=-1).view(bsz * h, seqlen, -1)
        attenOutput = torch.matmul(attenWeights, v)
        attenOutput = PermuteSelf(attenOutput.view(bsz, h, seqlen, d), (0, 2, 1, 3)).reshape(bsz, seqlen, h * d)
        return self.o_proj(attenOutput)


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class NormWeight(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


class Layer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.input_layernorm = NormWeight(cfg.hidden_size)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = NormWeight(cfg.hidden_size)
        self.mlp = MLP(cfg)


class Body(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([Layer(cfg) for _ in range(cfg.block_cnt)])
        self.norm = NormWeight(cfg.hidden_size)


class LlamaModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.model = Body(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        d = cfg.hidden_size // cfg.num_attention_heads
        self.rotary_dim = d
        inv = 1.0 / (cfg.rope_base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        ang = torch.arange(cfg.max_positions, dtype=torch.float64)[:, None] * inv[None]
        self.sinData = ang.sin()  # plain float64 attributes, cast at use
        self.cosData = ang.cos()
        self.pastKeyValues = None

    def reset_kv_cache(self):
        cfg = self.cfg
        d = cfg.hidden_size // cfg.num_attention_heads
        dtype = self.lm_head.weight.dtype
        n = cfg.max_batch * cfg.num_attention_heads
        self.pastKeyValues = [
            (torch.zeros(n, cfg.max_positions, d, dtype=dtype), torch.zeros(n, cfg.max_positions, d, dtype=dtype))
            for _ in range(cfg.block_cnt)
        ]
        self._state = {"len": 0}

    def forward(self, inputIds, use_cache=False):
        cfg = self.cfg
        bsz, seqlen = inputIds.shape
        cached = use_cache and self.pastKeyValues is not None
        if use_cache and self.pastKeyValues is None:
            self.reset_kv_cache()
            cached = True
        start = self._state["len"] if cached else 0
        positionIds = (torch.arange(seqlen, dtype=torch.float32) + start)[None].expand(bsz, -1)
        qpos = torch.arange(seqlen)[:, None] + start
        kpos = torch.arange(start + seqlen)[None, :]
        attentionMask = (kpos > qpos).to(torch.float32)[None].expand(bsz, -1, -1)
        rot = (self.sinData, self.cosData, self.rotary_dim)
        hiddenStates = self.model.embed_tokens(inputIds)
        for i, layer in enumerate(self.model.layers):
            attenInput = RMSNorm(hiddenStates, layer.input_layernorm.weight, cfg.rms_norm_eps)
            pkv = (*self.pastKeyValues[i], self._state) if cached else None
            hiddenStates = hiddenStates + layer.self_attn(attenInput, positionIds, attentionMask, rot, pkv)
            attenInput = RMSNorm(hiddenStates, layer.post_attention_layernorm.weight, cfg.rms_norm_eps)
            hiddenStates = hiddenStates + layer.mlp(attenInput)
        if cached:
            self._state["len"] = start + seqlen
        hiddenStates = RMSNorm(hiddenStates, self.model.norm.weight, cfg.rms_norm_eps)
        return self.lm_head(hiddenStates)


def make_model():
    torch.manual_seed(2103)
    cfg = SimpleNamespace(
        vocab_size=96, hidden_size=64, intermediate_size=128, block_cnt=3, num_attention_heads=4,
        rms_norm_eps=1e-6, rope_base=10000.0, max_positions=64, max_batch=4,
    )
    model = LlamaModel(cfg)
    g = torch.Generator().manual_seed(21031)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, NormWeight):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

"""scGPT (bowang-lab) single-cell foundation model, flash-attention encoder layer (FlashscGPTMHA /
FlashscGPTLayer) scaled down to 64 wide. One fused, biased Wqkv projection laid out
(three, heads, head_dim), a bidirectional attention core that runs on unpadded tokens described by
cumulative sequence lengths (cu_seqlens, as flash-attn's varlen kernels do; here a torch stand-in),
a biased out_proj, and scGPT's post-norm layer (norm_scheme="post").

This file: correct. scGPT FlashscGPTMHA: fused biased Wqkv as (three, heads, dim), unpadded tokens with cu_seqlens per cell, eager matmul/softmax/einsum stand-in for the varlen kernel, biased out_proj, post-norm layer"""

import math

import torch
import torch.nn.functional as F
from torch import nn


class ScGPTConfig:
    embsize = 64
    nhead = 8
    d_hid = 128
    dropout = 0.0
    norm_scheme = "post"


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale):
    """Stand-in for flash_attn_varlen_func on packed tokens: q/k/v are (total, heads, head_dim);
    each [cu[i], cu[i+1]) range is one sequence attending only to itself."""
    out = torch.empty_like(q)
    for i in range(cu_seqlens_q.numel() - 1):
        qs, qe = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        ks, ke = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        qi = q[qs:qe].transpose(0, 1)  # (heads, sq, d)
        ki = k[ks:ke].transpose(0, 1)
        vi = v[ks:ke].transpose(0, 1)
        scores = torch.matmul(qi, ki.transpose(-1, -2)) * softmax_scale
        attn = torch.softmax(scores, dim=-1)
        oi = torch.einsum("hqk,hkd->hqd", attn, vi)
        out[qs:qe] = oi.transpose(0, 1)
    return out


class FlashscGPTMHA(nn.Module):
    def __init__(self, embed_dim, num_heads, bias=True):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.softmax_scale = None  # None: 1/sqrt(head_dim), as flash-attn does
        self.Wqkv = nn.Linear(embed_dim, 3 * embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)

    def forward(self, pcpt_total_embs, key_padding_mask=None):
        batch, seqlen, _ = pcpt_total_embs.shape
        qkv = self.Wqkv(pcpt_total_embs)
        qkv = qkv.view(batch, seqlen, 3, self.num_heads, self.head_dim)
        # unpad: no padding mask here, so every row keeps all of its tokens
        qkv = qkv.reshape(batch * seqlen, 3, self.num_heads, self.head_dim)
        cu_seqlens = torch.arange(
            0, (batch + 1) * seqlen, seqlen, dtype=torch.int32, device=qkv.device
        )
        q, k, v = qkv.unbind(dim=1)
        scale = self.softmax_scale or 1.0 / math.sqrt(self.head_dim)
        context = varlen_attention(q, k, v, cu_seqlens, cu_seqlens, scale)
        context = context.reshape(batch, seqlen, self.num_heads * self.head_dim)
        return self.out_proj(context), None


class FlashscGPTLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.self_attn = FlashscGPTMHA(cfg.embsize, cfg.nhead)
        self.linear1 = nn.Linear(cfg.embsize, cfg.d_hid)
        self.linear2 = nn.Linear(cfg.d_hid, cfg.embsize)
        self.norm1 = nn.LayerNorm(cfg.embsize, eps=1e-5)
        self.norm2 = nn.LayerNorm(cfg.embsize, eps=1e-5)
        self.norm_scheme = cfg.norm_scheme

    def forward(self, pcpt_total_embs):
        attn_out = self.self_attn(pcpt_total_embs)[0]
        x = self.norm1(pcpt_total_embs + attn_out)
        return self.norm2(x + self.linear2(F.relu(self.linear1(x))))


class ContinuousValueEncoder(nn.Module):
    def __init__(self, d_model, max_value=512):
        super().__init__()
        self.linear1 = nn.Linear(d_model, d_model)
        self.linear2 = nn.Linear(d_model, d_model)
        self.norm = nn.LayerNorm(d_model)
        self.max_value = max_value

    def forward(self, x):
        x = torch.clamp(x, max=self.max_value)
        return self.norm(self.linear2(F.relu(self.linear1(x))))


class FlashTransformerEncoder(nn.Module):
    def __init__(self, cfg, nlayers=1):
        super().__init__()
        self.layers = nn.ModuleList([FlashscGPTLayer(cfg) for _ in range(nlayers)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class ScGPTModel(nn.Module):
    """Expression values (already embedded per gene, 64 wide) -> one scGPT encoder layer."""

    def __init__(self, cfg):
        super().__init__()
        self.value_encoder = ContinuousValueEncoder(cfg.embsize)
        self.transformer_encoder = FlashTransformerEncoder(cfg)

    def forward(self, values):
        return self.transformer_encoder(self.value_encoder(values))


def make_scgpt_encoder():
    torch.manual_seed(4505)
    model = ScGPTModel(ScGPTConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
            elif isinstance(mod, nn.Linear) and mod.bias is not None:
                mod.bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {
    "target": "make_scgpt_encoder",
    "kind": "multihead",
    "ok": True,
    "layer": "transformer_encoder.layers.0.self_attn",
    "structure": {
        "heads": 8,
        "kv_heads": 8,
        "head_dim": 8,
        "causal": False,
        "cross": False,
        "rope": None,
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "scGPT (bowang-lab) (c05): correct: scGPT FlashscGPTMHA: fused biased Wqkv as (three, "
    "heads, dim), unpadded tokens with cu_seqlens per cell, eager matmul/softmax/einsum "
    "stand-in for the varlen kernel, biased out_proj, post-norm layer",
}

"""A LLaMA written the way OpenBMB's ModelCenter (BMTrain) builds it (model_center/model/llama.py).

Llama: input_embedding, position_bias = RotaryEmbeddingESM (rotate-half pairing, base 1e4, kept at
model level and passed down as a callable), encoder (Encoder: layers = TransformerBlockList of
TransformerBlock, output_layernorm), lm head tied to the input embedding (projection).
TransformerBlock: self_att = SelfAttentionBlock (layernorm_before_attention, self_attention) and
ffn = FFNBlock (layernorm_before_ffn, ffn: w_in.w_0 / w_in.w_1 gated SiLU, w_out); post-residual
adds.  LayerNorm is ModelCenter's RMS variant with a `weight`.  Attention: project_q / project_k /
project_v / attention_out Linears without bias, heads (batch, num_heads, len, dim_head), rotary via
position_bias(h_q, h_k), score / sqrt(dim_head) (attn_scale), boolean mask (batch, len_q, len_k):
masked_fill(-inf), softmax, masked_fill(0) again, then the heads are merged with
view -> permute(0, 2, 1, 3) -> view.
Slip: layer 2's attention class comes from the tensor-parallel variant that merges heads after
`permute(0, 2, 3, 1)` (feature-major), so encoder.layers.2.self_att.self_attention hands attention_out
the concatenation ordered (dim_head, num_heads) instead of (num_heads, dim_head).
No cache.  Returns the logits tensor.
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
        "encoder.layers.0.self_att.self_attention",
        "encoder.layers.1.self_att.self_attention",
        "encoder.layers.2.self_att.self_attention",
    ],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "encoder.layers.2.self_att.self_attention",
    "stage": "output",
    "mistake": "heads_merge",
    "style": "OpenBMB ModelCenter llama: Encoder/TransformerBlock/SelfAttentionBlock tree, project_q/k/v + "
    "attention_out, model-level RotaryEmbeddingESM passed as position_bias, boolean mask with -inf fill and "
    "post-softmax zeroing; layer 2 merges heads feature-major via permute(0, 2, 3, 1)",
}


class LayerNorm(nn.Module):
    def __init__(self, dim_norm, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim_norm))

    def forward(self, x):
        variance = x.pow(2).mean(dim=-1, keepdim=True)
        return (x * torch.rsqrt(variance + self.eps)) * self.weight


class RotaryEmbeddingESM(nn.Module):
    def __init__(self, dim, base=10000.0):
        super().__init__()
        self.inv_freq64 = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))

    @staticmethod
    def rotate_half(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def forward(self, q, k):
        seq_len = k.shape[-2]
        t = torch.arange(seq_len, dtype=torch.float64)
        freqs = torch.outer(t, self.inv_freq64)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
        return (q * cos) + (self.rotate_half(q) * sin), (k * cos) + (self.rotate_half(k) * sin)


class Attention(nn.Module):
    def __init__(self, dim_model, num_heads, dim_head, attn_scale=True, merge_feature_major=False):
        super().__init__()
        self.num_heads = num_heads
        self.dim_head = dim_head
        self.attn_scale = attn_scale
        self.merge_feature_major = merge_feature_major
        self.project_q = nn.Linear(dim_model, num_heads * dim_head, bias=False)
        self.project_k = nn.Linear(dim_model, num_heads * dim_head, bias=False)
        self.project_v = nn.Linear(dim_model, num_heads * dim_head, bias=False)
        self.attention_out = nn.Linear(num_heads * dim_head, dim_model, bias=False)

    def forward(self, query, key_value, attention_mask=None, position_bias=None):
        batch_size, len_q, len_k = query.size(0), query.size(1), key_value.size(1)
        h_q = self.project_q(query).view(batch_size, len_q, self.num_heads, self.dim_head).permute(0, 2, 1, 3)
        h_k = self.project_k(key_value).view(batch_size, len_k, self.num_heads, self.dim_head).permute(0, 2, 1, 3)
        h_v = self.project_v(key_value).view(batch_size, len_k, self.num_heads, self.dim_head).permute(0, 2, 1, 3)
        if position_bias is not None:
            h_q, h_k = position_bias(h_q, h_k)
        score = torch.matmul(h_q, h_k.transpose(-1, -2))
        if self.attn_scale:
            score = score / math.sqrt(self.dim_head)
        if attention_mask is None:
            attention_mask = torch.ones(len_q, len_k, dtype=torch.bool, device=query.device).tril()[None]
        mask = attention_mask.view(-1, 1, len_q, len_k)
        score = torch.masked_fill(score, mask == False, float("-inf"))  # noqa: E712
        score = torch.softmax(score, dim=-1)
        score = torch.masked_fill(score, mask == False, 0.0)  # noqa: E712
        score = torch.matmul(score, h_v)  # (batch, num_heads, len_q, dim_head)
        if self.merge_feature_major:
            score = score.permute(0, 2, 3, 1).contiguous().view(batch_size, len_q, self.num_heads * self.dim_head)
        else:
            score = score.permute(0, 2, 1, 3).contiguous().view(batch_size, len_q, self.num_heads * self.dim_head)
        return self.attention_out(score)


class SelfAttentionBlock(nn.Module):
    def __init__(self, cfg, merge_feature_major=False):
        super().__init__()
        self.layernorm_before_attention = LayerNorm(cfg.dim_model, eps=cfg.norm_eps)
        self.self_attention = Attention(cfg.dim_model, cfg.num_heads, cfg.dim_head, merge_feature_major=merge_feature_major)

    def forward(self, hidden_states, attention_mask, position_bias):
        x = self.layernorm_before_attention(hidden_states)
        x = self.self_attention(x, x, attention_mask, position_bias)
        return hidden_states + x


class DenseGatedACT(nn.Module):
    def __init__(self, dim_in, dim_ff):
        super().__init__()
        self.w_0 = nn.Linear(dim_in, dim_ff, bias=False)
        self.w_1 = nn.Linear(dim_in, dim_ff, bias=False)

    def forward(self, x):
        return F.silu(self.w_0(x)) * self.w_1(x)


class FeedForward(nn.Module):
    def __init__(self, dim_model, dim_ff):
        super().__init__()
        self.w_in = DenseGatedACT(dim_model, dim_ff)
        self.w_out = nn.Linear(dim_ff, dim_model, bias=False)

    def forward(self, x):
        return self.w_out(self.w_in(x))


class FFNBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.layernorm_before_ffn = LayerNorm(cfg.dim_model, eps=cfg.norm_eps)
        self.ffn = FeedForward(cfg.dim_model, cfg.dim_ff)

    def forward(self, hidden_states):
        return hidden_states + self.ffn(self.layernorm_before_ffn(hidden_states))


class TransformerBlock(nn.Module):
    def __init__(self, cfg, merge_feature_major=False):
        super().__init__()
        self.self_att = SelfAttentionBlock(cfg, merge_feature_major)
        self.ffn = FFNBlock(cfg)

    def forward(self, hidden_states, attention_mask, position_bias):
        return self.ffn(self.self_att(hidden_states, attention_mask, position_bias))


class Encoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.layers = nn.ModuleList(
            [TransformerBlock(cfg, merge_feature_major=i in cfg.tp_attention_layers) for i in range(cfg.num_layers)]
        )
        self.output_layernorm = LayerNorm(cfg.dim_model, eps=cfg.norm_eps)

    def forward(self, hidden_states, attention_mask, position_bias):
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask, position_bias)
        return self.output_layernorm(hidden_states)


class Llama(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.input_embedding = nn.Embedding(cfg.vocab_size, cfg.dim_model)
        self.position_bias = RotaryEmbeddingESM(cfg.dim_head)
        self.encoder = Encoder(cfg)

    def forward(self, input):
        batch, seqlen = input.shape
        length = torch.full((batch,), seqlen, device=input.device)
        directional_mask_2d = torch.arange(seqlen, device=input.device) <= torch.arange(seqlen, device=input.device).view(-1, 1)
        attention_mask = (torch.arange(seqlen, device=input.device)[None, :] < length[:, None])[:, None, :]
        attention_mask = attention_mask & directional_mask_2d.view(1, seqlen, seqlen)
        hidden_states = self.input_embedding(input)
        hidden_states = self.encoder(hidden_states, attention_mask, self.position_bias)
        return hidden_states @ self.input_embedding.weight.T / math.sqrt(hidden_states.shape[-1])


def make_model():
    torch.manual_seed(2509)
    cfg = SimpleNamespace(
        vocab_size=96, dim_model=64, num_heads=4, dim_head=16, dim_ff=160, num_layers=3,
        norm_eps=1e-6, tp_attention_layers=(2,),
    )
    model = Llama(cfg)
    g = torch.Generator().manual_seed(25091)
    with torch.no_grad():
        model.input_embedding.weight.normal_(0.0, 1.0, generator=g)
        for m in model.modules():
            if isinstance(m, LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

"""NeoBERT (chandar-lab/NeoBERT) encoder: each `EncoderBlock` holds the attention itself (no separate
attention module): one fused `qkv` Linear viewed per head as (batch, seq, heads, 3 * dim_head) and
chunked into q, k, v; complex-number RoPE (`precompute_freqs_cis` with `torch.polar`, `view_as_complex`
on adjacent pairs, i.e. interleaved pairing); `F.scaled_dot_product_attention` with the additive
padding mask the model builds; `wo`; pre-norm RMSNorm (`attention_norm`, `ffn_norm`) and a SwiGLU FFN.
Bidirectional (encoder), so no causal mask.

This file: one bug: the fused qkv is viewed as (batch, heads, seq, 3 * dim_head) (no transpose), so a 'head' is cut across tokens."""

import torch
import torch.nn.functional as F
from torch import nn


class NeoBERTConfig:
    hidden_size = 64
    num_attention_heads = 4
    intermediate_size = 128
    max_length = 128
    norm_eps = 1e-5
    rope_theta = 10000.0

    @property
    def dim_head(self):
        return self.hidden_size // self.num_attention_heads


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def precompute_freqs_cis(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64)[: (dim // 2)] / dim))
    t = torch.arange(end, dtype=torch.float64)
    freqs = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(freqs), freqs)  # complex128


def reshape_for_broadcast(freqs_cis, x):
    # x: (batch, seq, heads, dim_head / 2) complex
    freqs_cis = freqs_cis[: x.shape[1]]
    return freqs_cis.view(1, x.shape[1], 1, x.shape[-1])


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.double().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.double().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = reshape_for_broadcast(freqs_cis, xq_)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class SwiGLU(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w12 = nn.Linear(dim, 2 * hidden, bias=False)
        self.w3 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        x1, x2 = self.w12(x).chunk(2, dim=-1)
        return self.w3(F.silu(x1) * x2)


class EncoderBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.qkv = nn.Linear(config.hidden_size, config.hidden_size * 3, bias=False)
        self.wo = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.ffn = SwiGLU(config.hidden_size, config.intermediate_size)
        self.attention_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.ffn_norm = RMSNorm(config.hidden_size, config.norm_eps)

    def forward(self, x, attention_mask, freqs_cis):
        x = x + self._att_block(self.attention_norm(x), attention_mask, freqs_cis)
        x = x + self.ffn(self.ffn_norm(x))
        return x

    def _att_block(self, x, attention_mask, freqs_cis):
        batch_size, seq_len, _ = x.shape
        heads, dim_head = self.config.num_attention_heads, self.config.dim_head
        xq, xk, xv = self.qkv(x).view(batch_size, heads, seq_len, dim_head * 3).transpose(1, 2).chunk(3, dim=-1)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        attn = F.scaled_dot_product_attention(
            query=xq.transpose(1, 2),
            key=xk.transpose(1, 2),
            value=xv.transpose(1, 2),
            attn_mask=attention_mask,
            dropout_p=0.0,
        ).transpose(1, 2)
        return self.wo(attn.reshape(batch_size, seq_len, heads * dim_head))


class NeoBERT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.register_buffer(
            "freqs_cis",
            precompute_freqs_cis(config.dim_head, config.max_length, config.rope_theta),
            persistent=False,
        )
        self.transformer_encoder = nn.ModuleList([EncoderBlock(config)])
        self.layer_norm = RMSNorm(config.hidden_size, config.norm_eps)

    def forward(self, inputs_embeds, attention_mask=None):
        batch_size, seq_len, _ = inputs_embeds.shape
        if attention_mask is None:
            attention_mask = torch.ones(batch_size, seq_len, device=inputs_embeds.device)
        # (batch, seq) padding mask -> additive (batch, heads, seq, seq)
        attention_mask = attention_mask[:, None, None, :].expand(
            batch_size, self.config.num_attention_heads, seq_len, seq_len
        )
        attention_mask = torch.where(attention_mask == 1, 0.0, float("-inf")).to(inputs_embeds.dtype)
        x = inputs_embeds
        for layer in self.transformer_encoder:
            x = layer(x, attention_mask, self.freqs_cis)
        return self.layer_norm(x)


def make_neobert():
    torch.manual_seed(2613)
    model = NeoBERT(NeoBERTConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, RMSNorm):
                mod.weight.uniform_(0.5, 1.5)
    return model.eval()


EXPECT = {'target': 'make_neobert',
 'kind': 'multihead',
 'ok': False,
 'layer': 'transformer_encoder.0',
 'stage': 'queries',
 'mistake': 'heads_split',
 'style': 'NeoBERT _att_block: qkv.view(b, heads, s, 3*dh) then transposed as if it were (b, s, '
          'heads, ...)'}

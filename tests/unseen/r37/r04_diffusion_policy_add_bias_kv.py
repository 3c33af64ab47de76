"""Diffusion Policy (real-stanford/diffusion_policy
`diffusion_policy/model/diffusion/transformer_for_diffusion.py`, TransformerForDiffusion): a
norm-first decoder layer over the noisy action tokens, causal self-attention then cross-
attention to the observation-condition memory. The self-attention is a
torch.nn.MultiheadAttention as in the original; the cross-attention is written out in the manner
of torch.nn.MultiheadAttention (batch_first): one packed `in_proj_weight` (3E, E) and
`in_proj_bias` chunked into q/k/v, heads folded onto the batch axis as (batch * heads),
`out_proj` Linear. Target takes (action tokens, condition tokens); the layer held to account is
the cross-attention `decoder.layers.0.multihead_attn`.

This file: refused (add_bias_kv: a learned bias_k / bias_v token appended to every sequence's
keys and values (nn.MultiheadAttention's add_bias_kv); 4 heads of 16, eager)"""

import torch
from torch import nn
from torch.nn import functional as F


class TransformerForDiffusionConfig:
    n_emb = 64
    n_head = 4
    n_layer = 1
    p_drop_attn = 0.0
    causal_attn = True
    use_sdpa = False
    add_bias_kv = True


class CrossMultiheadAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, bias=True, add_bias_kv=False, use_sdpa=False):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.use_sdpa = use_sdpa
        self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim)) if bias else None
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        if add_bias_kv:
            self.bias_k = nn.Parameter(torch.empty(1, 1, embed_dim))
            self.bias_v = nn.Parameter(torch.empty(1, 1, embed_dim))
        else:
            self.bias_k = self.bias_v = None
        nn.init.xavier_uniform_(self.in_proj_weight)
        if self.in_proj_bias is not None:
            nn.init.uniform_(self.in_proj_bias, -0.2, 0.2)
            nn.init.uniform_(self.out_proj.bias, -0.2, 0.2)
        if self.bias_k is not None:
            nn.init.normal_(self.bias_k)
            nn.init.normal_(self.bias_v)

    def forward(self, query, key, value, attn_mask=None):
        bsz, tgt_len, embed_dim = query.shape
        w_q, w_k, w_v = self.in_proj_weight.chunk(3)
        b_q, b_k, b_v = self.in_proj_bias.chunk(3)
        q = F.linear(query, w_q, b_q)
        k = F.linear(key, w_k, b_k)
        v = F.linear(value, w_v, b_v)
        if self.bias_k is not None:
            k = torch.cat([k, self.bias_k.expand(bsz, 1, embed_dim).to(k.dtype)], dim=1)
            v = torch.cat([v, self.bias_v.expand(bsz, 1, embed_dim).to(v.dtype)], dim=1)
            if attn_mask is not None:
                attn_mask = F.pad(attn_mask, (0, 1))
        src_len = k.shape[1]
        q = q.view(bsz, tgt_len, self.num_heads, self.head_dim).transpose(1, 2)
        q = q.reshape(bsz * self.num_heads, tgt_len, self.head_dim)
        k = k.view(bsz, src_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.reshape(bsz * self.num_heads, src_len, self.head_dim)
        v = v.view(bsz, src_len, self.num_heads, self.head_dim).transpose(1, 2)
        v = v.reshape(bsz * self.num_heads, src_len, self.head_dim)
        if self.use_sdpa:
            attn_output = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        else:
            q_scaled = q * self.head_dim**-0.5
            attn_weights = torch.bmm(q_scaled, k.transpose(-2, -1))
            if attn_mask is not None:
                attn_weights = attn_weights + attn_mask
            attn_weights = F.softmax(attn_weights, dim=-1)
            attn_output = torch.bmm(attn_weights, v)
        attn_output = attn_output.view(bsz, self.num_heads, tgt_len, self.head_dim)
        attn_output = attn_output.transpose(1, 2).reshape(bsz, tgt_len, embed_dim)
        return self.out_proj(attn_output)


class TransformerDecoderLayer(nn.Module):
    """norm_first=True with a GELU feed-forward, as TransformerForDiffusion configures it."""

    def __init__(self, config):
        super().__init__()
        e = config.n_emb
        self.self_attn = nn.MultiheadAttention(
            e, config.n_head, dropout=config.p_drop_attn, batch_first=True
        )
        self.multihead_attn = CrossMultiheadAttention(
            e, config.n_head, add_bias_kv=config.add_bias_kv, use_sdpa=config.use_sdpa
        )
        self.linear1 = nn.Linear(e, 4 * e)
        self.linear2 = nn.Linear(4 * e, e)
        self.norm1 = nn.LayerNorm(e)
        self.norm2 = nn.LayerNorm(e)
        self.norm3 = nn.LayerNorm(e)

    def forward(self, tgt, memory, tgt_mask=None):
        x = tgt
        h = self.norm1(x)
        x = x + self.self_attn(h, h, h, attn_mask=tgt_mask, need_weights=False)[0]
        h = self.norm2(x)
        x = x + self.multihead_attn(h, memory, memory)
        return x + self.linear2(F.gelu(self.linear1(self.norm3(x))))


class TransformerDecoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList(
            [TransformerDecoderLayer(config) for _ in range(config.n_layer)]
        )

    def forward(self, tgt, memory, tgt_mask=None):
        for layer in self.layers:
            tgt = layer(tgt, memory, tgt_mask=tgt_mask)
        return tgt


class TransformerForDiffusion(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.decoder = TransformerDecoder(config)
        self.ln_f = nn.LayerNorm(config.n_emb)

    def forward(self, sample_emb, cond_emb):
        T = sample_emb.shape[1]
        tgt_mask = None
        if self.config.causal_attn:
            mask = (torch.triu(torch.ones(T, T, device=sample_emb.device)) == 1).transpose(0, 1)
            tgt_mask = torch.zeros(T, T, dtype=sample_emb.dtype, device=sample_emb.device)
            tgt_mask = tgt_mask.masked_fill(~mask, float("-inf"))
        x = self.decoder(sample_emb, cond_emb, tgt_mask=tgt_mask)
        return self.ln_f(x)


def make_diffusion_policy_decoder():
    torch.manual_seed(3952)
    model = TransformerForDiffusion(TransformerForDiffusionConfig())
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
            elif isinstance(mod, nn.Linear) and mod.bias is not None:
                mod.bias.uniform_(-0.2, 0.2)
            elif isinstance(mod, nn.MultiheadAttention):
                mod.in_proj_bias.uniform_(-0.2, 0.2)
    return model.eval()


EXPECT = {
    "target": "make_diffusion_policy_decoder",
    "kind": "cross",
    "ok": True,
    "layer": "decoder.layers.0.multihead_attn",
    "unsupported": "bias_kv",
    "style": "Diffusion Policy TransformerForDiffusion cross-attention: refused "
    "(add_bias_kv: a learned bias_k / bias_v token appended to every sequence's "
    "keys and values (nn.MultiheadAttention's add_bias_kv); 4 heads of 16, eager)",
}

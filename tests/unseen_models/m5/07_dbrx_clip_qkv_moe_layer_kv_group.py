"""DBRX in the shape of transformers' modeling_dbrx.py (written from memory, in my own words):
`transformer.wte`, `transformer.blocks.N.norm_attn_norm` (norm_1, attn, norm_2; bias-free
LayerNorms), attention with one fused `Wqkv` split by size into q (8 heads of 8) and k, v (2 kv heads),
clip_qkv = 8 (clamp), rotate_half rotary base 500000, `out_proj`; `transformer.blocks.N.ffn` is a
small mixture of experts (router `ffn.router.layer`, 4 GLU experts stored as stacked w1/v1/w2
parameters, top-2 with normalised weights), `transformer.norm_f`, `lm_head`.  3 blocks.

Key/value heads are expanded with `repeat_kv` (query head h reads kv head h // 4) in every block
except block 1, whose config.attn_config.kv_expand_layers entry picks an "einops-style" expansion
that tiles the kv heads (kv head h % 2).  No cache.

Slip: `transformer.blocks.1.norm_attn_norm.attn` pairs query heads with the wrong kv heads
(stage `scores`, `kv_group_mapping`).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": [
        "transformer.blocks.0.norm_attn_norm.attn",
        "transformer.blocks.1.norm_attn_norm.attn",
        "transformer.blocks.2.norm_attn_norm.attn",
    ],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "transformer.blocks.1.norm_attn_norm.attn",
    "stage": "scores",
    "mistake": "kv_group_mapping",
    "style": "modeling_dbrx.py: blocks.N.norm_attn_norm.attn, fused Wqkv split by size, clip_qkv, GQA 8/2 (head_dim 8), "
    "rope base 5e5, bias-free LayerNorm, MoE ffn; slip: block 1 tiles kv heads (h % 2)",
}


class DbrxAttentionConfig:
    clip_qkv = 8.0
    kv_n_heads = 2
    rope_theta = 500000.0
    kv_expand_layers = ["repeat_kv", "tile", "repeat_kv"]


class DbrxConfig:
    vocab_size = 170
    d_model = 64
    n_heads = 8
    n_layers = 3
    ffn_hidden_size = 48
    moe_num_experts = 4
    moe_top_k = 2
    attn_config = DbrxAttentionConfig()


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class DbrxRotaryEmbedding(nn.Module):
    def __init__(self, dim, base):
        super().__init__()
        self.register_buffer(
            "inv_freq",
            1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)),
            persistent=False,
        )

    def forward(self, x, position_ids):
        freqs = position_ids[:, :, None].double() * self.inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype)[:, None], emb.sin().to(x.dtype)[:, None]


def repeat_kv(hidden_states, n_rep):
    b, kvh, s, d = hidden_states.shape
    hidden_states = hidden_states[:, :, None, :, :].expand(b, kvh, n_rep, s, d)
    return hidden_states.reshape(b, kvh * n_rep, s, d)


def tile_kv(hidden_states, n_rep):
    b, kvh, s, d = hidden_states.shape
    hidden_states = hidden_states[:, None, :, :, :].expand(b, n_rep, kvh, s, d)
    return hidden_states.reshape(b, n_rep * kvh, s, d)


class DbrxAttention(nn.Module):
    def __init__(self, config, block_idx):
        super().__init__()
        self.d_model = config.d_model
        self.num_heads = config.n_heads
        self.head_dim = self.d_model // self.num_heads
        self.attn_pdrop = 0.0
        self.clip_qkv = config.attn_config.clip_qkv
        self.num_key_value_heads = config.attn_config.kv_n_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.block_idx = block_idx
        self.expand = (
            repeat_kv if config.attn_config.kv_expand_layers[block_idx] == "repeat_kv" else tile_kv
        )
        self.Wqkv = nn.Linear(
            self.d_model, self.d_model + 2 * self.num_key_value_heads * self.head_dim, bias=False
        )
        self.out_proj = nn.Linear(self.d_model, self.d_model, bias=False)
        self.rotary_emb = DbrxRotaryEmbedding(self.head_dim, config.attn_config.rope_theta)

    def forward(self, hidden_states, position_ids, attention_mask):
        bsz, q_len, _ = hidden_states.size()
        qkv_states = self.Wqkv(hidden_states)
        qkv_states = qkv_states.clamp(min=-self.clip_qkv, max=self.clip_qkv)
        query_states, key_states, value_states = qkv_states.split(
            [
                self.d_model,
                self.num_key_value_heads * self.head_dim,
                self.num_key_value_heads * self.head_dim,
            ],
            dim=2,
        )
        query_states = query_states.view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = key_states.view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(
            1, 2
        )
        value_states = value_states.view(
            bsz, q_len, self.num_key_value_heads, self.head_dim
        ).transpose(1, 2)
        cos, sin = self.rotary_emb(value_states, position_ids)
        query_states = query_states * cos + rotate_half(query_states) * sin
        key_states = key_states * cos + rotate_half(key_states) * sin
        key_states = self.expand(key_states, self.num_key_value_groups)
        value_states = self.expand(value_states, self.num_key_value_groups)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / (self.head_dim**0.5)
        attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).contiguous().reshape(bsz, q_len, self.d_model)
        return self.out_proj(attn_output), attn_weights


class DbrxNormAttentionNorm(nn.Module):
    def __init__(self, config, block_idx):
        super().__init__()
        self.norm_1 = nn.LayerNorm(config.d_model, bias=False)
        self.attn = DbrxAttention(config, block_idx)
        self.norm_2 = nn.LayerNorm(config.d_model, bias=False)

    def forward(self, hidden_states, position_ids, attention_mask):
        residual_states = hidden_states
        hidden_states = self.norm_1(hidden_states)
        hidden_states, _ = self.attn(hidden_states, position_ids, attention_mask)
        hidden_states = hidden_states + residual_states
        residual_states = hidden_states
        return residual_states, self.norm_2(hidden_states)


class DbrxRouter(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.top_k = config.moe_top_k
        self.layer = nn.Linear(config.d_model, config.moe_num_experts, bias=False)

    def forward(self, hidden_states):
        weights = self.layer(hidden_states).softmax(dim=-1)
        top_weights, top_experts = torch.topk(weights, self.top_k, dim=-1)
        top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)
        return top_weights, top_experts


class DbrxExperts(nn.Module):
    def __init__(self, config):
        super().__init__()
        e, f, d = config.moe_num_experts, config.ffn_hidden_size, config.d_model
        self.w1 = nn.Parameter(torch.randn(e, f, d) * d**-0.5)
        self.v1 = nn.Parameter(torch.randn(e, f, d) * d**-0.5)
        self.w2 = nn.Parameter(torch.randn(e, f, d) * f**-0.5)

    def forward(self, x, top_weights, top_experts):
        out = torch.zeros_like(x)
        for slot in range(top_experts.shape[-1]):
            idx = top_experts[..., slot]
            w1, v1, w2 = self.w1[idx], self.v1[idx], self.w2[idx]
            h = F.silu(torch.einsum("...d,...fd->...f", x, w1)) * torch.einsum(
                "...d,...fd->...f", x, v1
            )
            out = out + top_weights[..., slot, None] * torch.einsum("...f,...fd->...d", h, w2)
        return out


class DbrxFFN(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.router = DbrxRouter(config)
        self.experts = DbrxExperts(config)

    def forward(self, x):
        top_weights, top_experts = self.router(x)
        return self.experts(x, top_weights, top_experts)


class DbrxBlock(nn.Module):
    def __init__(self, config, block_idx):
        super().__init__()
        self.norm_attn_norm = DbrxNormAttentionNorm(config, block_idx)
        self.ffn = DbrxFFN(config)

    def forward(self, hidden_states, position_ids, attention_mask):
        resid_states, hidden_states = self.norm_attn_norm(
            hidden_states, position_ids, attention_mask
        )
        return resid_states + self.ffn(hidden_states)


class DbrxModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList([DbrxBlock(config, i) for i in range(config.n_layers)])
        self.norm_f = nn.LayerNorm(config.d_model, bias=False)

    def forward(self, input_ids):
        bsz, seq_len = input_ids.shape
        hidden_states = self.wte(input_ids)
        position_ids = torch.arange(seq_len).unsqueeze(0).expand(bsz, -1)
        dtype = hidden_states.dtype
        mask = torch.triu(
            torch.full((seq_len, seq_len), torch.finfo(dtype).min, dtype=dtype), diagonal=1
        )[None, None]
        for block in self.blocks:
            hidden_states = block(hidden_states, position_ids, mask)
        return self.norm_f(hidden_states)


class MoeCausalLMOutput:
    def __init__(self, logits):
        self.logits = logits


class DbrxForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.transformer = DbrxModel(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)

    def forward(self, input_ids):
        return MoeCausalLMOutput(self.lm_head(self.transformer(input_ids)))


def make_model():
    torch.manual_seed(5707)
    model = DbrxForCausalLM(DbrxConfig())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn_like(m.weight))
    return model.eval()

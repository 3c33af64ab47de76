"""CodeShell (WisdomShell, remote code modeling_codeshell.py), reduced.

CodeShellForCausalLM: transformer (wte, h.N, ln_f) and lm_head; a GPT-BigCode-shaped tree (ln_1 -> attn
-> + residual, ln_2 -> mlp with c_fc/c_proj and gelu), LayerNorm with bias.  CodeShellAttention: one
fused `c_attn` (bias) producing q | k | v with `group_query_attention` (4 query heads, 2 kv heads),
rotary (rotate_half, base 1e4, position_ids), kv expanded to the query heads by `repeat_interleave` on
the head axis, matmul * 1/sqrt(d), causal `bias` buffer with -1e4 fill, `c_proj` (bias).
Slip: block 2 was swapped for the "export" attention of a fork (`CodeShellExportAttention`, chosen by
`config.export_layers`) that expands the kv heads with `Tensor.repeat` (tiling) instead of
`repeat_interleave`, so query head h reads kv head h % 2 instead of h // 2.  Blocks 0 and 1 are right.
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
    "layers": ["transformer.h.0.attn", "transformer.h.1.attn", "transformer.h.2.attn"],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "transformer.h.2.attn",
    "stage": "scores",
    "mistake": "kv_group_mapping",
    "style": "CodeShell modeling_codeshell.py: GPT-BigCode tree, fused c_attn q|k|v with group_query_attention 4/2, "
    "rotate_half rope; block 2's export attention tiles kv heads with .repeat (h -> h % 2)",
}


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class CodeShellRotaryEmbedding(nn.Module):
    def __init__(self, dim, max_position_embeddings=128, base=10000.0):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        t = torch.arange(max_position_embeddings, dtype=torch.float64)
        emb = torch.cat((torch.outer(t, inv_freq),) * 2, dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def forward(self, position_ids, dtype):
        return self.cos_cached[position_ids].to(dtype)[:, None], self.sin_cached[position_ids].to(dtype)[:, None]


class CodeShellAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.embed_dim = config.n_embd
        self.num_heads = config.n_head
        self.num_kv_heads = config.num_query_groups
        self.head_dim = self.embed_dim // self.num_heads
        self.kv_dim = self.num_kv_heads * self.head_dim
        self.group_size = self.num_heads // self.num_kv_heads
        self.c_attn = nn.Linear(self.embed_dim, self.embed_dim + 2 * self.kv_dim)
        self.c_proj = nn.Linear(self.embed_dim, self.embed_dim)
        self.rotary_emb = CodeShellRotaryEmbedding(self.head_dim)
        self.register_buffer("bias", torch.tril(torch.ones(128, 128, dtype=torch.bool)), persistent=False)
        self.layer_idx = layer_idx

    def _expand_kv(self, x):
        return x.repeat_interleave(self.group_size, dim=1)

    def forward(self, hidden_states, position_ids):
        bsz, q_len, _ = hidden_states.shape
        query, key, value = self.c_attn(hidden_states).split((self.embed_dim, self.kv_dim, self.kv_dim), dim=2)
        query = query.view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key = key.view(bsz, q_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        value = value.view(bsz, q_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary_emb(position_ids, query.dtype)
        query = query * cos + rotate_half(query) * sin
        key = key * cos + rotate_half(key) * sin
        key, value = self._expand_kv(key), self._expand_kv(value)
        attn_weights = torch.matmul(query, key.transpose(-1, -2)) / math.sqrt(self.head_dim)
        causal_mask = self.bias[None, None, :q_len, :q_len]
        attn_weights = torch.where(causal_mask, attn_weights, torch.full_like(attn_weights, -1e4))
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, value)
        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, self.embed_dim)
        return self.c_proj(attn_output)


class CodeShellExportAttention(CodeShellAttention):
    def _expand_kv(self, x):
        # the export graph avoids repeat_interleave (unsupported op in the target runtime)
        return x.repeat(1, self.group_size, 1, 1)


class CodeShellMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, config.n_inner)
        self.c_proj = nn.Linear(config.n_inner, config.n_embd)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class CodeShellBlock(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        attn_cls = CodeShellExportAttention if layer_idx in config.export_layers else CodeShellAttention
        self.attn = attn_cls(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = CodeShellMLP(config)

    def forward(self, hidden_states, position_ids):
        hidden_states = hidden_states + self.attn(self.ln_1(hidden_states), position_ids)
        return hidden_states + self.mlp(self.ln_2(hidden_states))


class CodeShellModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.h = nn.ModuleList([CodeShellBlock(config, i) for i in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)

    def forward(self, input_ids):
        bsz, q_len = input_ids.shape
        position_ids = torch.arange(q_len, device=input_ids.device).unsqueeze(0).expand(bsz, -1)
        hidden_states = self.wte(input_ids)
        for block in self.h:
            hidden_states = block(hidden_states, position_ids)
        return self.ln_f(hidden_states)


class CodeShellForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = CodeShellModel(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, input_ids):
        return SimpleNamespace(logits=self.lm_head(self.transformer(input_ids)))


def make_model():
    torch.manual_seed(1105)
    config = SimpleNamespace(vocab_size=96, n_embd=64, n_head=4, num_query_groups=2, n_layer=3, n_inner=160,
                             layer_norm_epsilon=1e-5, export_layers=(2,))
    model = CodeShellForCausalLM(config)
    g = torch.Generator().manual_seed(11051)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model.eval()

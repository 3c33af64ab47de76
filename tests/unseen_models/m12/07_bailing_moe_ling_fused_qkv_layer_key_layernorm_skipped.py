"""Ling / Bailing-MoE (inclusionAI modeling_bailing_moe.py), small config with random weights.

BailingMoeForCausalLM: model (word_embeddings, layers.N, norm) and lm_head.  BailingMoeDecoderLayer:
input_layernorm -> `attention` -> post_attention_layernorm -> mlp (layer 0 dense through
`first_k_dense_replace`, layers 1-2 a 4-expert top-2 softmax-routed MoE plus a shared expert).
BailingMoeAttention: one fused `query_key_value` Linear split by sizes (q 4 heads, k/v 2 heads, head
dim 16: GQA 4/2), `use_qk_norm`: per-head RMSNorm `query_layernorm`/`key_layernorm` applied before
the rotary, rotate_half rotary (base 6e5), eager matmul * scaling + finfo.min mask, output `dense`.
Slip: layer 2's attention was built with `use_qk_norm="query_only"` (a leftover from an ablation), so it
owns a `key_layernorm` but never applies it: keys reach the rotary unnormalised.
No cache.
"""

from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["model.layers.0.attention", "model.layers.1.attention", "model.layers.2.attention"],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "model.layers.2.attention",
    "stage": "normed_keys",
    "mistake": "qk_norm_missing",
    "style": "Bailing-MoE (Ling): word_embeddings, fused query_key_value split by sizes, GQA 4/2, per-head "
    "query_layernorm/key_layernorm before rotate_half rope, `dense` out-proj, MoE top-2 + shared expert; "
    "layer 2 owns key_layernorm but skips it",
}


class BailingMoeRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class BailingMoeAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.use_qk_norm = config.layer_qk_norm[layer_idx]
        self.query_key_value = nn.Linear(
            config.hidden_size, (self.num_heads + 2 * self.num_key_value_heads) * self.head_dim, bias=False)
        self.dense = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.query_layernorm = BailingMoeRMSNorm(self.head_dim)
        self.key_layernorm = BailingMoeRMSNorm(self.head_dim)
        self.rope_theta = config.rope_theta

    def _cos_sin(self, n, dtype):
        inv = 1.0 / self.rope_theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim)
        f = torch.outer(torch.arange(n, dtype=torch.float64), inv)
        emb = torch.cat((f, f), -1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, hidden_states, attention_mask):
        bsz, q_len, _ = hidden_states.size()
        qkv = self.query_key_value(hidden_states)
        qkv = qkv.view(bsz, q_len, self.num_heads + 2 * self.num_key_value_heads, self.head_dim)
        query_states, key_states, value_states = qkv.split(
            [self.num_heads, self.num_key_value_heads, self.num_key_value_heads], dim=-2)
        query_states = query_states.transpose(1, 2)
        key_states = key_states.transpose(1, 2)
        value_states = value_states.transpose(1, 2)
        if self.use_qk_norm is True:
            query_states = self.query_layernorm(query_states)
            key_states = self.key_layernorm(key_states)
        elif self.use_qk_norm == "query_only":
            query_states = self.query_layernorm(query_states)
        cos, sin = self._cos_sin(q_len, hidden_states.dtype)
        query_states = query_states * cos + rotate_half(query_states) * sin
        key_states = key_states * cos + rotate_half(key_states) * sin
        groups = self.num_heads // self.num_key_value_heads
        key_states = torch.repeat_interleave(key_states, groups, dim=1)
        value_states = torch.repeat_interleave(value_states, groups, dim=1)
        attn = torch.matmul(query_states, key_states.transpose(-1, -2)) * self.head_dim ** -0.5 + attention_mask
        attn = attn.softmax(dim=-1)
        out = torch.matmul(attn, value_states).transpose(1, 2).reshape(bsz, q_len, -1)
        return self.dense(out)


class BailingMoeMLP(nn.Module):
    def __init__(self, d, inter):
        super().__init__()
        self.gate_proj = nn.Linear(d, inter, bias=False)
        self.up_proj = nn.Linear(d, inter, bias=False)
        self.down_proj = nn.Linear(inter, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class BailingMoeSparseMoeBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList([BailingMoeMLP(config.hidden_size, config.moe_intermediate_size)
                                      for _ in range(config.num_experts)])
        self.shared_experts = BailingMoeMLP(config.hidden_size, config.moe_intermediate_size)

    def forward(self, x):
        probs = F.softmax(self.gate(x), dim=-1)
        w, idx = probs.topk(self.top_k, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            sel = (idx == e).to(x.dtype) * w
            out = out + sel.sum(-1, keepdim=True) * expert(x)
        return out + self.shared_experts(x)


class BailingMoeDecoderLayer(nn.Module):
    def __init__(self, config, i):
        super().__init__()
        self.attention = BailingMoeAttention(config, i)
        self.input_layernorm = BailingMoeRMSNorm(config.hidden_size)
        self.post_attention_layernorm = BailingMoeRMSNorm(config.hidden_size)
        if i < config.first_k_dense_replace:
            self.mlp = BailingMoeMLP(config.hidden_size, config.intermediate_size)
        else:
            self.mlp = BailingMoeSparseMoeBlock(config)

    def forward(self, h, mask):
        h = h + self.attention(self.input_layernorm(h), mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class BailingMoeModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([BailingMoeDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = BailingMoeRMSNorm(config.hidden_size)

    def forward(self, input_ids):
        n = input_ids.shape[1]
        h = self.word_embeddings(input_ids)
        mask = torch.triu(torch.full((n, n), torch.finfo(h.dtype).min, dtype=h.dtype), 1)[None, None]
        for layer in self.layers:
            h = layer(h, mask)
        return self.norm(h)


class BailingMoeForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = BailingMoeModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids):
        return SimpleNamespace(logits=self.lm_head(self.model(input_ids)))


def make_model():
    torch.manual_seed(1207)
    config = SimpleNamespace(vocab_size=96, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                             num_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=600000.0,
                             layer_qk_norm=[True, True, "query_only"])
    model = BailingMoeForCausalLM(config)
    g = torch.Generator().manual_seed(12071)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, BailingMoeRMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

"""FlexOlmo (AllenAI), after transformers' modeling_flex_olmo.py, reduced.

FlexOlmoForCausalLM: model (embed_tokens, layers.N = FlexOlmoDecoderLayer, norm, rotary_emb) and lm_head.
The decoder layer has no pre-norm: h = h + post_attention_layernorm(self_attn(h)); h = h +
post_feedforward_layernorm(mlp(h)), with a sparse MoE MLP (4 experts, top-2, softmax router, no
renormalisation).  FlexOlmoAttention: q/k/v/o bias-free, GQA 4/2, a QK norm over the whole projection
(`q_norm` RMSNorm(4*16), `k_norm` RMSNorm(2*16)) applied before the head split and before rotate_half
rotary (base 5e5), eager attention with a -inf causal mask.
Slip: in layer 1 `q_norm` is built but the queries bypass it (a leftover `skip_q_norm` flag from an
ablation); the keys are normed.  No cache.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["model.layers.0.self_attn", "model.layers.1.self_attn", "model.layers.2.self_attn"],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "model.layers.1.self_attn",
    "stage": "normed_queries",
    "mistake": "qk_norm_missing",
    "style": "modeling_flex_olmo.py: post-sublayer norms only, top-2 MoE, full-width q_norm/k_norm before the head "
    "split, GQA 4/2; layer 1 skips q_norm",
}


class FlexOlmoRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return (hidden_states * torch.rsqrt(variance + self.variance_epsilon)) * self.weight


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class FlexOlmoAttention(nn.Module):
    def __init__(self, layer_idx, hidden=64, heads=4, kv_heads=2, skip_q_norm=False):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = hidden // heads
        self.num_key_value_groups = heads // kv_heads
        self.scaling = self.head_dim ** -0.5
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=False)
        self.q_norm = FlexOlmoRMSNorm(heads * self.head_dim)
        self.k_norm = FlexOlmoRMSNorm(kv_heads * self.head_dim)
        self.skip_q_norm = skip_q_norm

    def forward(self, hidden_states, position_embeddings, attention_mask):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states)
        if not self.skip_q_norm:
            query_states = self.q_norm(query_states)
        key_states = self.k_norm(self.k_proj(hidden_states))
        value_states = self.v_proj(hidden_states)
        query_states = query_states.view(hidden_shape).transpose(1, 2)
        key_states = key_states.view(hidden_shape).transpose(1, 2)
        value_states = value_states.view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        query_states = query_states * cos + rotate_half(query_states) * sin
        key_states = key_states * cos + rotate_half(key_states) * sin
        key_states = torch.repeat_interleave(key_states, self.num_key_value_groups, dim=1)
        value_states = torch.repeat_interleave(value_states, self.num_key_value_groups, dim=1)
        w = torch.matmul(query_states, key_states.transpose(2, 3)) * self.scaling
        w = F.softmax(w + attention_mask, dim=-1)
        out = torch.matmul(w, value_states).transpose(1, 2).reshape(*input_shape, -1)
        return self.o_proj(out)


class FlexOlmoExpert(nn.Module):
    def __init__(self, hidden, inter):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class FlexOlmoSparseMoeBlock(nn.Module):
    def __init__(self, hidden=64, inter=64, num_experts=4, top_k=2):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList([FlexOlmoExpert(hidden, inter) for _ in range(num_experts)])

    def forward(self, hidden_states):
        b, s, h = hidden_states.shape
        x = hidden_states.reshape(-1, h)
        routing = F.softmax(self.gate(x), dim=-1)
        weights, selected = torch.topk(routing, self.top_k, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            hit = (selected == e)
            w = (weights * hit).sum(-1, keepdim=True)
            out = out + w * expert(x)
        return out.view(b, s, h)


class FlexOlmoDecoderLayer(nn.Module):
    def __init__(self, layer_idx):
        super().__init__()
        self.self_attn = FlexOlmoAttention(layer_idx, skip_q_norm=(layer_idx == 1))
        self.mlp = FlexOlmoSparseMoeBlock()
        self.post_attention_layernorm = FlexOlmoRMSNorm(64)
        self.post_feedforward_layernorm = FlexOlmoRMSNorm(64)

    def forward(self, hidden_states, position_embeddings, attention_mask):
        hidden_states = hidden_states + self.post_attention_layernorm(
            self.self_attn(hidden_states, position_embeddings, attention_mask))
        return hidden_states + self.post_feedforward_layernorm(self.mlp(hidden_states))


class FlexOlmoModel(nn.Module):
    def __init__(self, vocab=100, rope_theta=500000.0):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, 64)
        self.layers = nn.ModuleList([FlexOlmoDecoderLayer(i) for i in range(3)])
        self.norm = FlexOlmoRMSNorm(64)
        self.rope_theta = rope_theta

    def forward(self, input_ids):
        h = self.embed_tokens(input_ids)
        T = input_ids.shape[1]
        inv_freq = 1.0 / (self.rope_theta ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16))
        freqs = torch.arange(T, dtype=torch.float64)[None, :, None] * inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        pe = (emb.cos().to(h.dtype), emb.sin().to(h.dtype))
        mask = torch.triu(torch.full((T, T), float("-inf"), dtype=h.dtype, device=h.device), 1)[None, None]
        for layer in self.layers:
            h = layer(h, pe, mask)
        return self.norm(h)


class FlexOlmoForCausalLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = FlexOlmoModel()
        self.lm_head = nn.Linear(64, 100, bias=False)

    def forward(self, input_ids):
        return self.lm_head(self.model(input_ids))


def make_model():
    torch.manual_seed(1306)
    model = FlexOlmoForCausalLM()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, FlexOlmoRMSNorm):
                m.weight.copy_(1.0 + 0.2 * torch.randn_like(m.weight))
    return model.eval()

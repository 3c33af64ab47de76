"""Swiss AI Apertus decoder after transformers' modeling_apertus.py (small, random weights, no cache).

ApertusForCausalLM: model (embed_tokens, layers.N, norm, rotary_emb), lm_head.  ApertusDecoderLayer
names its norms `attention_layernorm` and `feedforward_layernorm`; ApertusMLP is up_proj ->
xIELU (trainable alpha_p / alpha_n) -> down_proj, no gate.  ApertusAttention: q/k/v/o without bias,
GQA 4/2, per-head RMSNorm `q_norm` / `k_norm` (gains over head_dim) applied before rotate_half
rotary (halves) base 12e6, eager matmul * scaling, finfo.min causal mask, softmax upcast to at least float32.
Slip: layer 1 is listed in the config's `qk_norm_skip_key_layers` (a debugging switch left on),
so its keys go to the rotation without `k_norm` while its queries are normed.
"""

from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": [
        "model.layers.0.self_attn",
        "model.layers.1.self_attn",
        "model.layers.2.self_attn",
    ],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "model.layers.1.self_attn",
    "stage": "normed_keys",
    "mistake": "qk_norm_missing",
    "style": "modeling_apertus.py: attention_layernorm/feedforward_layernorm, xIELU up/down MLP, per-head q_norm/k_norm "
    "RMSNorm before rotate_half base 12e6, GQA 4/2; layer 1 skips k_norm",
}


class ApertusRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


class XIELUActivation(nn.Module):
    def __init__(self, alpha_p_init=0.8, alpha_n_init=0.8, beta=0.5, eps=-1e-6):
        super().__init__()
        self.alpha_p = nn.Parameter(torch.log(torch.expm1(torch.tensor(alpha_p_init))).unsqueeze(0))
        self.alpha_n = nn.Parameter(torch.log(torch.expm1(torch.tensor(alpha_n_init - beta))).unsqueeze(0))
        self.beta = beta
        self.eps = eps

    def forward(self, x):
        alpha_p = F.softplus(self.alpha_p)
        alpha_n = self.beta + F.softplus(self.alpha_n)
        return torch.where(
            x > 0,
            alpha_p * x * x + self.beta * x,
            (torch.expm1(torch.clamp(x, max=self.eps)) - x) * alpha_n + self.beta * x,
        )


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def repeat_kv(x, n_rep):
    b, kv, s, d = x.shape
    return x[:, :, None].expand(b, kv, n_rep, s, d).reshape(b, kv * n_rep, s, d)


class ApertusAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=False)
        self.q_norm = ApertusRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = ApertusRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.skip_k_norm = layer_idx in config.qk_norm_skip_key_layers

    def forward(self, hidden_states, position_embeddings, attention_mask=None):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        q = self.q_norm(q)
        if not self.skip_k_norm:
            k = self.k_norm(k)
        cos, sin = position_embeddings
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k = repeat_kv(k, self.num_key_value_groups)
        v = repeat_kv(v, self.num_key_value_groups)
        w = torch.matmul(q, k.transpose(2, 3)) * self.scaling
        if attention_mask is not None:
            w = w + attention_mask
        w = F.softmax(w, dim=-1, dtype=torch.promote_types(q.dtype, torch.float32)).to(q.dtype)
        out = torch.matmul(w, v).transpose(1, 2).reshape(*input_shape, -1)
        return self.o_proj(out), w


class ApertusMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = XIELUActivation()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.up_proj(x)))


class ApertusDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = ApertusAttention(config, layer_idx)
        self.mlp = ApertusMLP(config)
        self.attention_layernorm = ApertusRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.feedforward_layernorm = ApertusRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask, position_embeddings):
        h, _ = self.self_attn(hidden_states=self.attention_layernorm(hidden_states),
                              position_embeddings=position_embeddings, attention_mask=attention_mask)
        hidden_states = hidden_states + h
        return hidden_states + self.mlp(self.feedforward_layernorm(hidden_states))


class ApertusRotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        d = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x, position_ids):
        freqs = position_ids[..., None].to(x.dtype) * self.inv_freq.to(x.dtype)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


class ApertusModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([ApertusDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = ApertusRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = ApertusRotaryEmbedding(config)

    def forward(self, input_ids):
        b, t = input_ids.shape
        h = self.embed_tokens(input_ids)
        pos = torch.arange(t, device=h.device)[None].expand(b, -1)
        mask = torch.triu(torch.full((t, t), torch.finfo(h.dtype).min, dtype=h.dtype, device=h.device), 1)
        pe = self.rotary_emb(h, pos)
        for layer in self.layers:
            h = layer(h, mask[None, None], pe)
        return self.norm(h)


class ApertusForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = ApertusModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids):
        return SimpleNamespace(logits=self.lm_head(self.model(input_ids)))


def make_model():
    torch.manual_seed(907)
    config = SimpleNamespace(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=12000000.0,
                             rms_norm_eps=1e-5, qk_norm_skip_key_layers=(1,))
    model = ApertusForCausalLM(config)
    g = torch.Generator().manual_seed(9071)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, ApertusRMSNorm):
                m.weight.copy_(1.0 + 0.4 * torch.randn(m.weight.shape, generator=g))
        for layer in model.model.layers:
            # make the key norm matter: keys far from unit RMS
            layer.self_attn.k_proj.weight.mul_(3.0)
    return model.eval()

"""LiquidAI LFM2, after transformers' modeling_lfm2.py (hybrid short-convolution / attention decoder).

Lfm2ForCausalLM: model (embed_tokens, layers.N, embedding_norm -- LFM2's name for the final norm) and
lm_head.  Lfm2DecoderLayer: operator_norm -> (self_attn or conv) -> + residual, ffn_norm -> feed_forward
(w1/w3/w2 SwiGLU).  `layer_types` = full_attention, conv, full_attention, full_attention: layer 1 is a
Lfm2ShortConv (in_proj -> B, C, x; depthwise causal conv1d of width 3 on B*x; C * conv; out_proj), the
others hold Lfm2Attention: q_proj/k_proj/v_proj/out_proj without bias, GQA 4/2 (repeat_kv), per-head
RMSNorm `q_layernorm`/`k_layernorm` on (b, s, h, d) before the rotary (rotate_half, theta 1e6), eager
matmul * head_dim**-0.5, additive finfo.min mask.
Slip: layer 3's attention (`Lfm2Attention` with `config.norm_after_rope_layers` = (3,), a port of an
experiment that fused the norms into the rotary kernel) applies q_layernorm/k_layernorm after the
rotation instead of before it.  Attention layers 0 and 2 are right.  No cache.
"""

from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["model.layers.0.self_attn", "model.layers.2.self_attn", "model.layers.3.self_attn"],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "model.layers.3.self_attn",
    "stage": "normed_queries",
    "mistake": "qk_norm_misplaced",
    "style": "modeling_lfm2.py: hybrid layer_types (attention, short conv, attention, attention), operator_norm/ffn_norm, "
    "embedding_norm, per-head q_layernorm/k_layernorm, GQA 4/2, rope theta 1e6; layer 3 norms q/k after the rotation",
}


class Lfm2RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class Lfm2RotaryEmbedding(nn.Module):
    def __init__(self, dim, base):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)),
                             persistent=False)

    def forward(self, x, position_ids):
        freqs = position_ids[..., None].to(torch.float64) * self.inv_freq.to(torch.float64)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def repeat_kv(hidden_states, n_rep):
    b, kvh, s, d = hidden_states.shape
    return hidden_states[:, :, None].expand(b, kvh, n_rep, s, d).reshape(b, kvh * n_rep, s, d)


class Lfm2Attention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.num_heads = config.num_attention_heads
        self.num_kv = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_kv
        self.scaling = self.head_dim ** -0.5
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv * self.head_dim, bias=False)
        self.out_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.q_layernorm = Lfm2RMSNorm(self.head_dim, eps=config.norm_eps)
        self.k_layernorm = Lfm2RMSNorm(self.head_dim, eps=config.norm_eps)
        self.norm_after_rope = layer_idx in config.norm_after_rope_layers

    def forward(self, hidden_states, position_embeddings, attention_mask):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(hidden_shape)
        k = self.k_proj(hidden_states).view(hidden_shape)
        v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        if self.norm_after_rope:
            q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            q = self.q_layernorm(q)
            k = self.k_layernorm(k)
        else:
            q = self.q_layernorm(q).transpose(1, 2)
            k = self.k_layernorm(k).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k = repeat_kv(k, self.num_key_value_groups)
        v = repeat_kv(v, self.num_key_value_groups)
        attn_weights = torch.matmul(q, k.transpose(2, 3)) * self.scaling
        attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.promote_types(q.dtype, torch.float32)).to(q.dtype)
        attn_output = torch.matmul(attn_weights, v).transpose(1, 2).contiguous()
        return self.out_proj(attn_output.reshape(*input_shape, -1))


class Lfm2ShortConv(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.L_cache = config.conv_L_cache
        self.conv = nn.Conv1d(config.hidden_size, config.hidden_size, kernel_size=self.L_cache,
                              groups=config.hidden_size, padding=self.L_cache - 1, bias=False)
        self.in_proj = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=False)
        self.out_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, x):
        seqlen = x.shape[1]
        BCx = self.in_proj(x).transpose(-1, -2)
        B, C, x = BCx.chunk(3, dim=-2)
        Bx = B * x
        conv_out = self.conv(Bx)[..., :seqlen]
        y = (C * conv_out).transpose(-1, -2).contiguous()
        return self.out_proj(y)


class Lfm2MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.w1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.w3 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Lfm2DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.is_attention_layer = config.layer_types[layer_idx] == "full_attention"
        if self.is_attention_layer:
            self.self_attn = Lfm2Attention(config, layer_idx)
        else:
            self.conv = Lfm2ShortConv(config, layer_idx)
        self.feed_forward = Lfm2MLP(config)
        self.operator_norm = Lfm2RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.ffn_norm = Lfm2RMSNorm(config.hidden_size, eps=config.norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask):
        residual = hidden_states
        if self.is_attention_layer:
            hidden_states = self.self_attn(self.operator_norm(hidden_states), position_embeddings, attention_mask)
        else:
            hidden_states = self.conv(self.operator_norm(hidden_states))
        hidden_states = hidden_states + residual
        return hidden_states + self.feed_forward(self.ffn_norm(hidden_states))


class Lfm2Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([Lfm2DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.pos_emb = Lfm2RotaryEmbedding(config.hidden_size // config.num_attention_heads, config.rope_theta)
        self.embedding_norm = Lfm2RMSNorm(config.hidden_size, eps=config.norm_eps)

    def forward(self, input_ids):
        bsz, q_len = input_ids.shape
        hidden_states = self.embed_tokens(input_ids)
        position_ids = torch.arange(q_len, device=input_ids.device)[None].expand(bsz, -1)
        position_embeddings = self.pos_emb(hidden_states, position_ids)
        mask = torch.zeros(q_len, q_len, dtype=hidden_states.dtype)
        mask = mask.masked_fill(torch.ones(q_len, q_len, dtype=torch.bool).triu(1), torch.finfo(hidden_states.dtype).min)
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_embeddings, mask[None, None])
        return self.embedding_norm(hidden_states)


class Lfm2ForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = Lfm2Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids):
        return SimpleNamespace(logits=self.lm_head(self.model(input_ids)))


def make_model():
    torch.manual_seed(1107)
    config = SimpleNamespace(vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, norm_eps=1e-5, rope_theta=1000000.0,
                             conv_L_cache=3, layer_types=["full_attention", "conv", "full_attention", "full_attention"],
                             norm_after_rope_layers=(3,))
    model = Lfm2ForCausalLM(config)
    g = torch.Generator().manual_seed(11071)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, Lfm2RMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

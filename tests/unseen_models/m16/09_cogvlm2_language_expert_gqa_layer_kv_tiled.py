"""CogVLM2's language model (THUDM cogvlm2-llama3 modeling_cogvlm.py) used on text tokens only.

CogVLMForCausalLM: model (CogVLMModel: embed_tokens, layers.N, norm), lm_head.  CogVLMDecoderLayer is
pre-norm: input_layernorm -> self_attn -> + residual -> post_attention_layernorm -> mlp -> + residual.
VisionExpertAttention keeps both experts: vision_expert_query_key_value (bias) / vision_expert_dense
and language_expert_query_key_value (no bias) / language_expert_dense; tokens are routed by
token_type_ids (all LANGUAGE_TOKEN_TYPE = 0 when none are given, so only the language expert runs).
The fused projection is split by stride [heads, mq_heads, mq_heads] * head_dim (GQA 4/2,
num_multi_query_heads 2), heads transposed to (b, h, s, d), FastRotaryEmbedding (halves, base 5e5) at
position_ids, then keys/values are widened for the query heads with unsqueeze(2).expand(...).view(...)
(query head h -> kv head h // 2), and attention_fn runs SDPA with is_causal=True when the mask is the
plain lower triangle.  VisionExpertMLP has language_mlp / vision_mlp (gate/up/down SiLU).
Slip: the config chooses a kv widening per layer (`kv_expand` = grouped, broadcast, grouped); layer 1's
"broadcast" helper widens with unsqueeze(1).expand(...) over a new leading group axis, so query head h
reads kv head h % 2.
No cache.  Returns an object with `.logits`.
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
        "model.layers.0.self_attn",
        "model.layers.1.self_attn",
        "model.layers.2.self_attn",
    ],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "model.layers.1.self_attn",
    "stage": "scores",
    "mistake": "kv_group_mapping",
    "style": "CogVLM2 VisionExpertAttention on text tokens: language/vision expert fused qkv split by stride "
    "[H, KV, KV], rotary halves base 5e5, GQA 4/2 widened by unsqueeze(2).expand, SDPA is_causal via attention_fn; "
    "layer 1 widens with unsqueeze(1).expand (kv head h % 2)",
}

LANGUAGE_TOKEN_TYPE = 0
VISION_TOKEN_TYPE = 1


class RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def get_expert_mask(token_type_ids):
    vision_token_mask = torch.zeros_like(token_type_ids, dtype=torch.bool)
    vision_token_mask[:, :-1] = (token_type_ids[:, :-1] == VISION_TOKEN_TYPE) & (
        token_type_ids[:, 1:] == VISION_TOKEN_TYPE
    )
    language_token_mask = ~vision_token_mask
    return vision_token_mask, language_token_mask


class VisionExpertMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.language_mlp = MLP(config)
        self.vision_mlp = MLP(config)

    def forward(self, hidden_states, token_type_ids):
        output = torch.zeros_like(hidden_states)
        vision_token_mask, language_token_mask = get_expert_mask(token_type_ids)
        output[vision_token_mask] = self.vision_mlp(hidden_states[vision_token_mask])
        output[language_token_mask] = self.language_mlp(hidden_states[language_token_mask])
        return output


class FastRotaryEmbedding(nn.Module):
    def __init__(self, dim, base=500000):
        super().__init__()
        self.dim = dim
        self.base = base

    def _cos_sin(self, position_ids, dtype):
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2, dtype=torch.float64) / self.dim))
        freqs = position_ids.to(torch.float64)[..., None] * inv_freq.to(position_ids.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]

    @staticmethod
    def _rotate_half(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def forward(self, q, k, position_ids):
        cos, sin = self._cos_sin(position_ids, q.dtype)
        q = q * cos + self._rotate_half(q) * sin
        k = k * cos + self._rotate_half(k) * sin
        return q, k


def attention_fn(query_layer, key_layer, value_layer, attention_mask, scaling_attention_score=True):
    attention_mask_bool = attention_mask == 0
    is_low_triangle = (
        attention_mask_bool.shape[-1] == attention_mask_bool.shape[-2]
        and bool((attention_mask_bool == torch.ones_like(attention_mask_bool, dtype=torch.bool).tril()).all())
    )
    if is_low_triangle:
        return F.scaled_dot_product_attention(query_layer, key_layer, value_layer, attn_mask=None, dropout_p=0.0, is_causal=True)
    return F.scaled_dot_product_attention(query_layer, key_layer, value_layer, attn_mask=attention_mask, dropout_p=0.0)


class VisionExpertAttention(nn.Module):
    def __init__(self, config, kv_expand="grouped"):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_attention_heads = config.num_attention_heads
        self.num_multi_query_heads = config.num_multi_query_heads
        self.hidden_size_per_attention_head = self.hidden_size // self.num_attention_heads
        self.stride = [self.num_attention_heads, self.num_multi_query_heads, self.num_multi_query_heads]
        self.qkv_size = self.hidden_size + self.hidden_size_per_attention_head * self.num_multi_query_heads * 2
        self.head_dim = self.hidden_size_per_attention_head
        self.kv_expand = kv_expand
        self.rotary_emb = FastRotaryEmbedding(dim=self.head_dim, base=config.rope_theta)
        self.vision_expert_query_key_value = nn.Linear(self.hidden_size, self.qkv_size, bias=True)
        self.vision_expert_dense = nn.Linear(self.hidden_size, self.hidden_size, bias=False)
        self.language_expert_query_key_value = nn.Linear(self.hidden_size, self.qkv_size, bias=False)
        self.language_expert_dense = nn.Linear(self.hidden_size, self.hidden_size, bias=False)

    def _transpose_for_scores(self, tensor):
        new_tensor_shape = tensor.size()[:-1] + (-1, self.hidden_size_per_attention_head)
        return tensor.view(*new_tensor_shape).permute(0, 2, 1, 3)

    def _expand(self, states, bsz):
        groups = self.num_attention_heads // self.num_multi_query_heads
        if self.kv_expand == "grouped":
            states = states.unsqueeze(2).expand(-1, -1, groups, -1, -1)
        else:  # "broadcast"
            states = states.unsqueeze(1).expand(-1, groups, -1, -1, -1)
        return states.contiguous().view(bsz, self.num_attention_heads, *states.shape[3:])

    def forward(self, hidden_states, token_type_ids, position_ids, attention_mask=None):
        bsz, q_len, _ = hidden_states.size()
        vision_token_mask, language_token_mask = get_expert_mask(token_type_ids)
        shape = list(hidden_states.shape)
        shape[-1] = self.qkv_size
        mixed_raw_layer = torch.zeros(shape, dtype=hidden_states.dtype, device=hidden_states.device)
        mixed_raw_layer[vision_token_mask] = self.vision_expert_query_key_value(hidden_states[vision_token_mask])
        mixed_raw_layer[language_token_mask] = self.language_expert_query_key_value(hidden_states[language_token_mask])
        factor = mixed_raw_layer.size()[-1] // sum(self.stride)
        query_states, key_states, value_states = torch.split(mixed_raw_layer, [factor * x for x in self.stride], dim=-1)
        query_states = self._transpose_for_scores(query_states)
        key_states = self._transpose_for_scores(key_states)
        value_states = self._transpose_for_scores(value_states)
        query_states, key_states = self.rotary_emb(query_states, key_states, position_ids=position_ids)
        key_states = self._expand(key_states, bsz)
        value_states = self._expand(value_states, bsz)
        context_layer = attention_fn(query_states, key_states, value_states, attention_mask)
        context_layer = context_layer.transpose(1, 2).contiguous().reshape(bsz, q_len, self.hidden_size)
        attn_output = torch.zeros(context_layer.shape, dtype=hidden_states.dtype, device=hidden_states.device)
        attn_output[vision_token_mask] = self.vision_expert_dense(context_layer[vision_token_mask])
        attn_output[language_token_mask] = self.language_expert_dense(context_layer[language_token_mask])
        return attn_output


class CogVLMDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = VisionExpertAttention(config, config.kv_expand[layer_idx])
        self.mlp = VisionExpertMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, token_type_ids, position_ids, attention_mask=None):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = self.self_attn(
            hidden_states=hidden_states, token_type_ids=token_type_ids,
            position_ids=position_ids, attention_mask=attention_mask,
        )
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.mlp(self.post_attention_layernorm(hidden_states), token_type_ids=token_type_ids)
        return residual + hidden_states


class CogVLMModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([CogVLMDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids, token_type_ids=None):
        bsz, seq_len = input_ids.shape
        if token_type_ids is None:
            token_type_ids = torch.full_like(input_ids, LANGUAGE_TOKEN_TYPE)
        inputs_embeds = self.embed_tokens(input_ids)
        position_ids = torch.arange(seq_len, device=input_ids.device).unsqueeze(0).expand(bsz, -1)
        dtype = inputs_embeds.dtype
        mask = torch.full((seq_len, seq_len), torch.finfo(dtype).min, dtype=dtype, device=input_ids.device)
        mask = torch.triu(mask, diagonal=1)[None, None].expand(bsz, 1, -1, -1)
        hidden_states = inputs_embeds
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(hidden_states, token_type_ids, position_ids, attention_mask=mask)
        return self.norm(hidden_states)


class CogVLMForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = CogVLMModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, token_type_ids=None):
        return SimpleNamespace(logits=self.lm_head(self.model(input_ids, token_type_ids)))


def make_model():
    torch.manual_seed(1609)
    config = SimpleNamespace(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_multi_query_heads=2,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        kv_expand=["grouped", "broadcast", "grouped"],
    )
    model = CogVLMForCausalLM(config)
    g = torch.Generator().manual_seed(16091)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

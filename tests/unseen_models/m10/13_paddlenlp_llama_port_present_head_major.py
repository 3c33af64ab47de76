"""PaddleNLP's Llama (paddlenlp/transformers/llama/modeling.py) ported to torch with Paddle's conventions.

LlamaForCausalLM: llama (LlamaModel: embed_tokens, layers.N, norm) and lm_head (LlamaLMHead holding a
Paddle-layout `weight` of shape (hidden, vocab), applied as hidden @ weight).  Every projection is a
Paddle-style `Linear` whose `weight` is (in_features, out_features).  Activations stay in Paddle's
[batch, seq, heads, head_dim] layout: LlamaRotaryEmbedding keeps cos_cached/sin_cached of shape
(1, max_pos, 1, hd) (halves, base 1e4) sliced by position_ids; GQA 4/2 by repeat_interleave on axis 2;
`scaled_dot_product_attention` transposes to [b, h, s, d] itself, adds the additive mask built by
`_prepare_decoder_attention_mask` (finfo.min), softmax in float32, and transposes back.
Cache: hf, a tuple of per-layer (key, value) tuples in [b, s, kv_heads, d], concatenated on axis 1:
`out = model(ids, use_cache=True)`, then `model(tok, past_key_values=out.past_key_values, use_cache=True)`;
logits in `out.logits`.
Slip (decode only): the attention stores its present *after* the head-major transpose done for the
fused-kernel path, i.e. as [b, kv_heads, s, d], while the next call still concatenates the cache with
the new [b, 1, kv_heads, d] keys on axis 1.  The first decoding step raises in layer 0 (or, when the
prompt length happens to equal the kv-head count, mixes positions with heads).  Full forward and
prompt pass are exact.
"""

from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": ["llama.layers.0.self_attn", "llama.layers.1.self_attn", "llama.layers.2.self_attn"],
    "kind": "causal-multihead",
    "cache": "hf",
    "decode": {"mistake": "cache_other", "step": 0, "layer": "llama.layers.0.self_attn"},
    "style": "PaddleNLP llama modeling.py port: Paddle (in, out) Linear weights, [b, s, h, d] layout throughout, "
    "cos_cached (1, max, 1, d), tuple cache cat on axis 1, lm_head (hidden, vocab); slip: present stored "
    "head-major [b, kv, s, d] so step 0's concat raises",
}


class Linear(nn.Module):
    def __init__(self, in_features, out_features, bias_attr=False):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(in_features, out_features) * in_features**-0.5)
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias_attr else None

    def forward(self, x):
        y = torch.matmul(x, self.weight)
        return y if self.bias is None else y + self.bias


class LlamaRMSNorm(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(config.hidden_size))
        self.variance_epsilon = config.rms_norm_eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return hidden_states * torch.rsqrt(variance + self.variance_epsilon) * self.weight


class LlamaRotaryEmbedding(nn.Module):
    def __init__(self, dim, max_position_embeddings=128, base=10000):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        t = torch.arange(max_position_embeddings, dtype=torch.float64)
        freqs = torch.einsum("i,j->ij", t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos_cached", emb.cos()[None, :, None, :], persistent=False)
        self.register_buffer("sin_cached", emb.sin()[None, :, None, :], persistent=False)

    def forward(self, x, seq_len=None):
        return self.cos_cached[:, :seq_len].to(x.dtype), self.sin_cached[:, :seq_len].to(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids):
    cos = cos.squeeze(0).squeeze(1)[position_ids].unsqueeze(2)  # [bs, seq, 1, d]
    sin = sin.squeeze(0).squeeze(1)[position_ids].unsqueeze(2)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def scaled_dot_product_attention(query_states, key_states, value_states, attention_mask):
    bsz, q_len, num_heads, head_dim = query_states.shape
    query_states = query_states.transpose(1, 2)
    key_states = key_states.transpose(1, 2)
    value_states = value_states.transpose(1, 2)
    attn_weights = torch.matmul(query_states / head_dim**0.5, key_states.transpose(2, 3))
    attn_weights = attn_weights + attention_mask
    attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.promote_types(attn_weights.dtype, torch.float32)).to(query_states.dtype)
    attn_output = torch.matmul(attn_weights, value_states).transpose(1, 2)
    return attn_output.reshape(bsz, q_len, num_heads * head_dim), key_states, value_states


class LlamaAttention(nn.Module):
    def __init__(self, config, layerwise_recompute=False):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.q_proj = Linear(self.hidden_size, self.num_heads * self.head_dim)
        self.k_proj = Linear(self.hidden_size, self.num_key_value_heads * self.head_dim)
        self.v_proj = Linear(self.hidden_size, self.num_key_value_heads * self.head_dim)
        self.o_proj = Linear(self.num_heads * self.head_dim, self.hidden_size)
        self.rotary_emb = LlamaRotaryEmbedding(self.head_dim, base=config.rope_theta)

    def forward(self, hidden_states, position_ids=None, past_key_value=None, attention_mask=None, use_cache=False):
        bsz, q_len, _ = hidden_states.shape
        target_shape = [bsz, q_len, -1, self.head_dim]
        query_states = self.q_proj(hidden_states).reshape(target_shape)
        key_states = self.k_proj(hidden_states).reshape(target_shape)
        value_states = self.v_proj(hidden_states).reshape(target_shape)
        kv_seq_len = key_states.shape[-3]
        if past_key_value is not None:
            kv_seq_len += past_key_value[0].shape[-3]
        cos, sin = self.rotary_emb(value_states, seq_len=kv_seq_len)
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin, position_ids)
        if past_key_value is not None:
            key_states = torch.cat([past_key_value[0], key_states], dim=1)
            value_states = torch.cat([past_key_value[1], value_states], dim=1)
        key_states = key_states.repeat_interleave(self.num_key_value_groups, dim=2)
        value_states = value_states.repeat_interleave(self.num_key_value_groups, dim=2)
        kv_heads = self.num_key_value_heads
        attn_output, key_hm, value_hm = scaled_dot_product_attention(query_states, key_states, value_states,
                                                                     attention_mask)
        # present from the head-major tensors of the fused path, un-repeated
        past_key_value = (key_hm[:, :: self.num_key_value_groups][:, :kv_heads],
                          value_hm[:, :: self.num_key_value_groups][:, :kv_heads]) if use_cache else None
        return self.o_proj(attn_output), past_key_value


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = Linear(config.hidden_size, config.intermediate_size)
        self.up_proj = Linear(config.hidden_size, config.intermediate_size)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = LlamaAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config)
        self.post_attention_layernorm = LlamaRMSNorm(config)

    def forward(self, hidden_states, position_ids, attention_mask, past_key_value, use_cache):
        residual = hidden_states
        hidden_states, present = self.self_attn(self.input_layernorm(hidden_states), position_ids, past_key_value,
                                                attention_mask, use_cache)
        hidden_states = residual + hidden_states
        hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states, present


class LlamaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = LlamaRMSNorm(config)

    @staticmethod
    def _prepare_decoder_attention_mask(q_len, past_len, dtype, device):
        rows = past_len + torch.arange(q_len, device=device)
        visible = torch.arange(past_len + q_len, device=device)[None, :] <= rows[:, None]
        return torch.zeros(q_len, past_len + q_len, dtype=dtype, device=device).masked_fill(
            ~visible, torch.finfo(dtype).min)[None, None]

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        batch_size, seq_length = input_ids.shape
        if past_key_values is None:
            past_key_values = tuple([None] * len(self.layers))
        cache_length = past_key_values[0][0].shape[1] if past_key_values[0] is not None else 0
        position_ids = torch.arange(cache_length, cache_length + seq_length, device=input_ids.device)
        position_ids = position_ids.unsqueeze(0).expand(batch_size, -1)
        hidden_states = self.embed_tokens(input_ids)
        attention_mask = self._prepare_decoder_attention_mask(seq_length, cache_length, hidden_states.dtype,
                                                              input_ids.device)
        next_decoder_cache = () if use_cache else None
        for decoder_layer, past_key_value in zip(self.layers, past_key_values):
            hidden_states, present = decoder_layer(hidden_states, position_ids, attention_mask, past_key_value, use_cache)
            if use_cache:
                next_decoder_cache += (present,)
        return self.norm(hidden_states), next_decoder_cache


class LlamaLMHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(config.hidden_size, config.vocab_size) * config.hidden_size**-0.5)

    def forward(self, hidden_states):
        return torch.matmul(hidden_states, self.weight)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.llama = LlamaModel(config)
        self.lm_head = LlamaLMHead(config)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        hidden_states, cache = self.llama(input_ids, past_key_values=past_key_values, use_cache=use_cache)
        return SimpleNamespace(logits=self.lm_head(hidden_states), past_key_values=cache)


def make_model():
    torch.manual_seed(0)
    config = SimpleNamespace(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=10000.0)
    model = LlamaForCausalLM(config)
    for m in model.modules():
        if isinstance(m, LlamaRMSNorm):
            nn.init.uniform_(m.weight, 0.6, 1.4)
    return model.eval()

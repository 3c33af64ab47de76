"""EXAONE 3.0 in the shape of LG AI's modeling_exaone.py (written from memory, in my own words): a
GPT-2-like outer layout -- `transformer.wte`, `transformer.h.N` with `ln_1`, `attn`, `ln_2`, `mlp`
(`c_fc_0`, `c_fc_1`, `c_proj`, SwiGLU), `transformer.ln_f`, `lm_head` -- around a Llama-style
attention.  `attn` is ExaoneAttentionBlock, a thin wrapper whose only child `attn.attention`
(ExaoneSelfAttention: q_proj, k_proj, v_proj, out_proj, no bias) does all the work.  GQA 4 heads /
2 kv heads of 16, rotate_half rotary base 1e6, RMSNorm, additive finfo.min causal mask built from
the cache position for multi-token calls (none for one-token calls, as in Meta's llama), 3 layers.

Cache (hf): out = model(prompt, use_cache=True); out = model(tok, past_key_values=out.past_key_values,
use_cache=True).  With use_cache=True the model creates an ExaoneCache (defined below); positions
come from its `seen_tokens` counter, which the model advances once per call.

Slip (decoding only): the self-attention already stores its new keys/values with cache.update(), and
the model's legacy loop stores each layer's returned `present` (the new keys/values) a second time,
so after the prompt every layer's cache holds the prompt twice.  The prompt call itself attends
correctly.  Decode: `cache_stale`, step 0, `transformer.h.0.attn.attention`.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": False,
    "layers": [
        "transformer.h.0.attn.attention",
        "transformer.h.1.attn.attention",
        "transformer.h.2.attn.attention",
    ],
    "kind": "causal-multihead",
    "cache": "hf",
    "decode": {"mistake": "cache_stale", "step": 0, "layer": "transformer.h.0.attn.attention"},
    "style": "modeling_exaone.py: transformer.h.N.attn.attention (wrapper + inner self-attention), c_fc_0/c_fc_1 "
    "SwiGLU, GQA 4/2, rope 1e6; slip: legacy presents loop writes each layer's new k/v a second time",
}


class ExaoneConfig:
    vocab_size = 160
    hidden_size = 64
    intermediate_size = 112
    num_layers = 3
    num_attention_heads = 4
    num_key_value_heads = 2
    rope_theta = 1000000.0
    layer_norm_epsilon = 1e-5


class ExaoneCache:
    def __init__(self, num_layers):
        self.key_cache = [None] * num_layers
        self.value_cache = [None] * num_layers
        self.seen_tokens = 0

    def update(self, key_states, value_states, layer_idx):
        if self.key_cache[layer_idx] is None:
            self.key_cache[layer_idx] = key_states
            self.value_cache[layer_idx] = value_states
        else:
            self.key_cache[layer_idx] = torch.cat([self.key_cache[layer_idx], key_states], dim=-2)
            self.value_cache[layer_idx] = torch.cat(
                [self.value_cache[layer_idx], value_states], dim=-2
            )
        return self.key_cache[layer_idx], self.value_cache[layer_idx]

    def get_seq_length(self):
        return self.seen_tokens


class ExaoneRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class ExaoneRotaryEmbedding(nn.Module):
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
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    hidden_states = hidden_states[:, :, None, :, :].expand(
        batch, num_key_value_heads, n_rep, slen, head_dim
    )
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class ExaoneSelfAttention(nn.Module):
    def __init__(self, config, layer_id):
        super().__init__()
        self.layer_id = layer_id
        self.embed_dim = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.embed_dim // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.rotary = ExaoneRotaryEmbedding(self.head_dim, config.rope_theta)
        self.q_proj = nn.Linear(self.embed_dim, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(
            self.embed_dim, self.num_key_value_heads * self.head_dim, bias=False
        )
        self.v_proj = nn.Linear(
            self.embed_dim, self.num_key_value_heads * self.head_dim, bias=False
        )
        self.out_proj = nn.Linear(self.num_heads * self.head_dim, self.embed_dim, bias=False)

    def forward(self, hidden_states, attention_mask, position_ids, past_key_value=None):
        bsz, q_len, _ = hidden_states.size()
        query_states = (
            self.q_proj(hidden_states)
            .view(bsz, q_len, self.num_heads, self.head_dim)
            .transpose(1, 2)
        )
        key_states = (
            self.k_proj(hidden_states)
            .view(bsz, q_len, self.num_key_value_heads, self.head_dim)
            .transpose(1, 2)
        )
        value_states = (
            self.v_proj(hidden_states)
            .view(bsz, q_len, self.num_key_value_heads, self.head_dim)
            .transpose(1, 2)
        )
        cos, sin = self.rotary(value_states, position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        query_states = query_states * cos + rotate_half(query_states) * sin
        key_states = key_states * cos + rotate_half(key_states) * sin
        present = (key_states, value_states)
        if past_key_value is not None:
            key_states, value_states = past_key_value.update(
                key_states, value_states, self.layer_id
            )
        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / (self.head_dim**0.5)
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).contiguous().reshape(bsz, q_len, self.embed_dim)
        return self.out_proj(attn_output), present


class ExaoneAttentionBlock(nn.Module):
    def __init__(self, config, layer_id):
        super().__init__()
        self.attention = ExaoneSelfAttention(config, layer_id)

    def forward(self, hidden_states, attention_mask, position_ids, past_key_value=None):
        return self.attention(hidden_states, attention_mask, position_ids, past_key_value)


class ExaoneGatedMLP(nn.Module):
    def __init__(self, intermediate_size, config):
        super().__init__()
        self.c_fc_0 = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.c_fc_1 = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.c_proj = nn.Linear(intermediate_size, config.hidden_size, bias=False)

    def forward(self, hidden_states):
        return self.c_proj(F.silu(self.c_fc_0(hidden_states)) * self.c_fc_1(hidden_states))


class ExaoneBlock(nn.Module):
    def __init__(self, config, layer_id):
        super().__init__()
        self.ln_1 = ExaoneRMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.attn = ExaoneAttentionBlock(config, layer_id)
        self.ln_2 = ExaoneRMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.mlp = ExaoneGatedMLP(config.intermediate_size, config)

    def forward(self, hidden_states, attention_mask, position_ids, layer_past):
        residual = hidden_states
        attn_output, present = self.attn(
            self.ln_1(hidden_states), attention_mask, position_ids, layer_past
        )
        hidden_states = residual + attn_output
        return hidden_states + self.mlp(self.ln_2(hidden_states)), present


class ExaoneModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.h = nn.ModuleList([ExaoneBlock(config, i) for i in range(config.num_layers)])
        self.ln_f = ExaoneRMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)

    def forward(self, input_ids, past_key_values=None):
        bsz, seq_len = input_ids.shape
        hidden_states = self.wte(input_ids)
        past_length = past_key_values.get_seq_length() if past_key_values is not None else 0
        cache_position = torch.arange(past_length, past_length + seq_len)
        position_ids = cache_position.unsqueeze(0).expand(bsz, -1)
        mask = None
        if seq_len > 1:
            dtype = hidden_states.dtype
            target = past_length + seq_len
            mask = torch.zeros(seq_len, target, dtype=dtype)
            mask = mask.masked_fill(
                torch.arange(target)[None, :] > cache_position[:, None], torch.finfo(dtype).min
            )
            mask = mask[None, None]
        for i, block in enumerate(self.h):
            hidden_states, present = block(hidden_states, mask, position_ids, past_key_values)
            if past_key_values is not None:
                # legacy path kept from the tuple-cache days: store this layer's present
                past_key_values.update(present[0], present[1], i)
        if past_key_values is not None:
            past_key_values.seen_tokens += seq_len
        return self.ln_f(hidden_states)


class CausalLMOutputWithPast:
    def __init__(self, logits, past_key_values):
        self.logits = logits
        self.past_key_values = past_key_values


class ExaoneForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = ExaoneModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        if use_cache and past_key_values is None:
            past_key_values = ExaoneCache(self.config.num_layers)
        hidden_states = self.transformer(input_ids, past_key_values if use_cache else None)
        return CausalLMOutputWithPast(
            self.lm_head(hidden_states), past_key_values if use_cache else None
        )


def make_model():
    torch.manual_seed(6414)
    model = ExaoneForCausalLM(ExaoneConfig())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, ExaoneRMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn_like(m.weight))
    return model.eval()

"""ChatGLM2-6B in the shape of its modeling_chatglm.py (written from memory, in my own words):
sequence-first hidden states (seq, batch, hidden) everywhere, `transformer.embedding.word_embeddings`,
`transformer.encoder.layers.N.self_attention` with one fused `query_key_value` Linear (with bias)
laid out [all queries | group keys | group values] (multi_query_group_num = 2 groups for 4 heads),
keys/values expanded to the heads with unsqueeze/expand (query head h uses group h // 2), a rope cache
of stacked (cos, sin) pairs applied to the first half of each 16-wide head with interleaved pairs
(GLM's "2d" rotary: x.reshape(..., rot/2, 2)), base 10000, RMSNorm, SwiGLU `dense_h_to_4h`
producing both halves, `dense` output projection without bias, final RMSNorm and `output_layer`.

Cache (hf): out = model(prompt, use_cache=True); out = model(tok, past_key_values=out.past_key_values,
use_cache=True).  past_key_values is a tuple per layer of (key, value), each (seq, batch, groups,
head_dim), concatenated along dim 0 (ChatGLM2's layout).  A one-token step uses no mask.

Correct.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": [
        "transformer.encoder.layers.0.self_attention",
        "transformer.encoder.layers.1.self_attention",
        "transformer.encoder.layers.2.self_attention",
    ],
    "kind": "causal-multihead",
    "cache": "hf",
    "structure": {
        "heads": 4,
        "kv_heads": 2,
        "head_dim": 16,
        "causal": True,
        "cross": False,
        "rope": {"pairing": "interleaved", "fraction": 0.5, "base": 10000.0},
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "ChatGLM2 modeling_chatglm.py: seq-first, fused query_key_value [q | k groups | v groups] with bias, "
    "multi_query_group_num 2, rope on half of each head (interleaved pairs), tuple cache (s, b, g, d)",
}


class ChatGLMConfig:
    padded_vocab_size = 130
    hidden_size = 64
    num_attention_heads = 4
    kv_channels = 16
    multi_query_group_num = 2
    ffn_hidden_size = 96
    num_layers = 3
    layernorm_epsilon = 1e-5
    add_qkv_bias = True
    seq_length = 256


class RMSNorm(nn.Module):
    def __init__(self, normalized_shape, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(normalized_shape))
        self.eps = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.eps))


class RotaryEmbedding(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.dim = dim

    def forward(self, seq_len, dtype, offset=0):
        theta = 1.0 / (10000 ** (torch.arange(0, self.dim, 2, dtype=torch.float64) / self.dim))
        seq_idx = torch.arange(offset, offset + seq_len, dtype=torch.float64)
        idx_theta = torch.outer(seq_idx, theta)
        cache = torch.stack([torch.cos(idx_theta), torch.sin(idx_theta)], dim=-1)
        return cache.to(dtype)  # [seq, dim/2, 2]


def apply_rotary_pos_emb(x, rope_cache):
    # x: [sq, b, np, hn]
    sq, b, np_, hn = x.size()
    rot_dim = rope_cache.shape[-2] * 2
    x, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    rope_cache = rope_cache[:sq]
    xshaped = x.reshape(sq, -1, np_, rot_dim // 2, 2)
    rope_cache = rope_cache.view(sq, 1, 1, rot_dim // 2, 2)
    x_out2 = torch.stack(
        [
            xshaped[..., 0] * rope_cache[..., 0] - xshaped[..., 1] * rope_cache[..., 1],
            xshaped[..., 1] * rope_cache[..., 0] + xshaped[..., 0] * rope_cache[..., 1],
        ],
        -1,
    )
    x_out2 = x_out2.flatten(3)
    return torch.cat((x_out2, x_pass), dim=-1)


class CoreAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.hidden_size_per_partition = config.kv_channels * config.num_attention_heads
        self.norm_factor = config.kv_channels**0.5

    def forward(self, query_layer, key_layer, value_layer, attention_mask):
        # [sq, b, np, hn] -> [b, np, sq, hn]
        q, k, v = [t.permute(1, 2, 0, 3) for t in (query_layer, key_layer, value_layer)]
        scores = torch.matmul(q, k.transpose(-1, -2)) / self.norm_factor
        if attention_mask is not None:
            scores = scores.masked_fill(attention_mask, float("-inf"))
        probs = F.softmax(scores, dim=-1)
        context = torch.matmul(probs, v)  # [b, np, sq, hn]
        context = context.permute(2, 0, 1, 3).contiguous()
        return context.view(*context.shape[:2], self.hidden_size_per_partition)


class SelfAttention(nn.Module):
    def __init__(self, config, layer_number):
        super().__init__()
        self.layer_number = layer_number
        self.projection_size = config.kv_channels * config.num_attention_heads
        self.hidden_size_per_attention_head = config.kv_channels
        self.num_attention_heads_per_partition = config.num_attention_heads
        self.num_multi_query_groups_per_partition = config.multi_query_group_num
        self.qkv_hidden_size = (
            self.projection_size + 2 * config.kv_channels * config.multi_query_group_num
        )
        self.query_key_value = nn.Linear(
            config.hidden_size, self.qkv_hidden_size, bias=config.add_qkv_bias
        )
        self.core_attention = CoreAttention(config)
        self.dense = nn.Linear(self.projection_size, config.hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask, rotary_pos_emb, kv_cache=None, use_cache=True):
        mixed_x_layer = self.query_key_value(hidden_states)
        hn = self.hidden_size_per_attention_head
        g = self.num_multi_query_groups_per_partition
        (query_layer, key_layer, value_layer) = mixed_x_layer.split(
            [self.num_attention_heads_per_partition * hn, g * hn, g * hn], dim=-1
        )
        query_layer = query_layer.view(
            query_layer.size()[:-1] + (self.num_attention_heads_per_partition, hn)
        )
        key_layer = key_layer.view(key_layer.size()[:-1] + (g, hn))
        value_layer = value_layer.view(value_layer.size()[:-1] + (g, hn))

        query_layer = apply_rotary_pos_emb(query_layer, rotary_pos_emb)
        key_layer = apply_rotary_pos_emb(key_layer, rotary_pos_emb)

        if kv_cache is not None:
            cache_k, cache_v = kv_cache
            key_layer = torch.cat((cache_k, key_layer), dim=0)
            value_layer = torch.cat((cache_v, value_layer), dim=0)
        kv_cache = (key_layer, value_layer) if use_cache else None

        per_group = self.num_attention_heads_per_partition // g
        key_layer = key_layer.unsqueeze(-2).expand(-1, -1, -1, per_group, -1)
        key_layer = key_layer.contiguous().view(
            key_layer.size()[:2] + (self.num_attention_heads_per_partition, hn)
        )
        value_layer = value_layer.unsqueeze(-2).expand(-1, -1, -1, per_group, -1)
        value_layer = value_layer.contiguous().view(
            value_layer.size()[:2] + (self.num_attention_heads_per_partition, hn)
        )
        context_layer = self.core_attention(query_layer, key_layer, value_layer, attention_mask)
        return self.dense(context_layer), kv_cache


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(config.hidden_size, config.ffn_hidden_size * 2, bias=False)
        self.dense_4h_to_h = nn.Linear(config.ffn_hidden_size, config.hidden_size, bias=False)

    def forward(self, hidden_states):
        x = self.dense_h_to_4h(hidden_states)
        a, b = torch.chunk(x, 2, dim=-1)
        return self.dense_4h_to_h(F.silu(a) * b)


class GLMBlock(nn.Module):
    def __init__(self, config, layer_number):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.self_attention = SelfAttention(config, layer_number)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.mlp = MLP(config)

    def forward(self, hidden_states, attention_mask, rotary_pos_emb, kv_cache=None, use_cache=True):
        layernorm_output = self.input_layernorm(hidden_states)
        attention_output, kv_cache = self.self_attention(
            layernorm_output, attention_mask, rotary_pos_emb, kv_cache=kv_cache, use_cache=use_cache
        )
        layernorm_input = hidden_states + attention_output
        layernorm_output = self.post_attention_layernorm(layernorm_input)
        return layernorm_input + self.mlp(layernorm_output), kv_cache


class GLMTransformer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList([GLMBlock(config, i + 1) for i in range(config.num_layers)])
        self.final_layernorm = RMSNorm(config.hidden_size, eps=config.layernorm_epsilon)

    def forward(
        self, hidden_states, attention_mask, rotary_pos_emb, kv_caches=None, use_cache=True
    ):
        if not kv_caches:
            kv_caches = [None] * len(self.layers)
        presents = ()
        for index, layer in enumerate(self.layers):
            hidden_states, kv_cache = layer(
                hidden_states, attention_mask, rotary_pos_emb, kv_caches[index], use_cache
            )
            if use_cache:
                presents = presents + (kv_cache,)
        return self.final_layernorm(hidden_states), presents


class Embedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.padded_vocab_size, config.hidden_size)

    def forward(self, input_ids):
        return self.word_embeddings(input_ids).transpose(0, 1).contiguous()


class ModelOutput:
    def __init__(self, logits, past_key_values):
        self.logits = logits
        self.past_key_values = past_key_values


class ChatGLMModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embedding = Embedding(config)
        self.seq_length = config.seq_length
        self.rotary_pos_emb = RotaryEmbedding(config.kv_channels // 2)
        self.encoder = GLMTransformer(config)
        self.output_layer = nn.Linear(config.hidden_size, config.padded_vocab_size, bias=False)

    def get_masks(self, seq_length, past_length):
        full = torch.ones(seq_length, past_length + seq_length, dtype=torch.bool)
        return ~torch.tril(full, diagonal=past_length)  # True = masked


class ChatGLMForConditionalGeneration(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.transformer = ChatGLMModel(config)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        batch_size, seq_length = input_ids.shape
        past_length = past_key_values[0][0].shape[0] if past_key_values is not None else 0
        inputs_embeds = self.transformer.embedding(input_ids)
        full_attention_mask = None
        if seq_length > 1:
            full_attention_mask = self.transformer.get_masks(seq_length, past_length)
        rotary_pos_emb = self.transformer.rotary_pos_emb(
            seq_length, inputs_embeds.dtype, offset=past_length
        )
        hidden_states, presents = self.transformer.encoder(
            inputs_embeds,
            full_attention_mask,
            rotary_pos_emb,
            kv_caches=past_key_values,
            use_cache=use_cache,
        )
        lm_logits = self.transformer.output_layer(hidden_states).transpose(0, 1).contiguous()
        return ModelOutput(lm_logits, presents if use_cache else None)


def make_model():
    torch.manual_seed(5202)
    model = ChatGLMForConditionalGeneration(ChatGLMConfig())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn_like(m.weight))
    return model.eval()

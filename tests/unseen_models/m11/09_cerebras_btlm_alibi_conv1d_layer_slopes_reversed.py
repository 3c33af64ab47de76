"""Cerebras BTLM-3B-8K (remote code modeling_btlm.py), reduced.

BTLMLMHeadModel: transformer (BTLMModel: wte, no learned positions, relative_pe =
AlibiPositionEmbeddingLayer, h.N, ln_f) and lm_head.  BTLMBlock: ln_1 -> attn -> + residual, ln_2 -> mlp
(SwiGLU with c_fc, c_fc2, c_proj, GPT-2 Conv1D layout (in, out)).  BTLMAttention: fused Conv1D c_attn
split into q/k/v, 6 heads of 16 (non-power-of-two ALiBi), scores = q k^T / head_dim**attn_scale_power
(0.5 here: mup_scale_qk_dot_by_d is off), a tril `bias` buffer with masked_bias -10000, then the
model-level ALiBi `position_bias` (-slope * |i - j|, slopes from _get_alibi_slopes) is added, softmax,
c_proj.
Slip: block 1 is a `BTLMTPShardAttention` (config.tp_shard_layers): it re-gathers the position bias
from a tensor-parallel layout and ends up with the heads in reverse order (slopes 2^-3, 2^-1, 2^-8,
2^-6, 2^-4, 2^-2 for heads 0..5).  Blocks 0 and 2 are right.  No cache.
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
    "layer": "transformer.h.1.attn",
    "stage": "biased_scores",
    "mistake": "bias_slopes",
    "style": "BTLM modeling_btlm.py: Conv1D (in, out), model-level AlibiPositionEmbeddingLayer with 6-head slopes, "
    "SwiGLU c_fc/c_fc2, -10000 masked_bias; block 1's TP-shard attention flips the bias over heads",
}


class Conv1D(nn.Module):
    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.02 * math.sqrt(50.0 / nx))
        self.bias = nn.Parameter(torch.randn(nf) * 0.02)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


class AlibiPositionEmbeddingLayer(nn.Module):
    def __init__(self, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.register_buffer("slopes", torch.tensor(self._get_alibi_slopes(num_heads), dtype=torch.float64).unsqueeze(-1),
                             persistent=False)

    def forward(self, seq_length, key_length, dtype):
        context_position = torch.arange(seq_length)[:, None]
        memory_position = torch.arange(key_length)[None, :]
        relative_position = torch.abs(memory_position - context_position).unsqueeze(0).expand(self.num_heads, -1, -1)
        alibi = (self.slopes * -1.0).unsqueeze(1) * relative_position.to(torch.float64)
        return alibi.to(dtype)

    @staticmethod
    def _get_alibi_slopes(n):
        def get_slopes_power_of_2(n):
            start = 2 ** (-(2 ** -(math.log2(n) - 3)))
            return [start * start ** i for i in range(n)]

        if math.log2(n).is_integer():
            return get_slopes_power_of_2(n)
        closest_power_of_2 = 2 ** math.floor(math.log2(n))
        return (get_slopes_power_of_2(closest_power_of_2)
                + AlibiPositionEmbeddingLayer._get_alibi_slopes(2 * closest_power_of_2)[0::2][: n - closest_power_of_2])


class BTLMAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.embed_dim = config.n_embd
        self.num_heads = config.n_head
        self.head_dim = self.embed_dim // self.num_heads
        self.attn_scale_power = 1.0 if config.mup_scale_qk_dot_by_d else 0.5
        self.c_attn = Conv1D(3 * self.embed_dim, self.embed_dim)
        self.c_proj = Conv1D(self.embed_dim, self.embed_dim)
        self.register_buffer("bias", torch.tril(torch.ones(128, 128, dtype=torch.bool)).view(1, 1, 128, 128),
                             persistent=False)
        self.register_buffer("masked_bias", torch.tensor(-1e4), persistent=False)
        self.layer_idx = layer_idx

    def _split_heads(self, tensor):
        new_shape = tensor.size()[:-1] + (self.num_heads, self.head_dim)
        return tensor.view(new_shape).permute(0, 2, 1, 3)

    def _gather_bias(self, position_bias):
        return position_bias

    def _attn(self, query, key, value, position_bias):
        attn_weights = torch.matmul(query, key.transpose(-1, -2))
        attn_weights = attn_weights / torch.full([], value.size(-1) ** self.attn_scale_power,
                                                 dtype=attn_weights.dtype, device=attn_weights.device)
        query_length, key_length = query.size(-2), key.size(-2)
        causal_mask = self.bias[:, :, key_length - query_length:key_length, :key_length]
        mask_value = self.masked_bias.to(attn_weights.dtype)
        attn_weights = torch.where(causal_mask, attn_weights, mask_value)
        attn_weights = attn_weights + self._gather_bias(position_bias).unsqueeze(0)
        attn_weights = F.softmax(attn_weights, dim=-1)
        return torch.matmul(attn_weights, value)

    def forward(self, hidden_states, position_bias):
        query, key, value = self.c_attn(hidden_states).split(self.embed_dim, dim=2)
        query, key, value = self._split_heads(query), self._split_heads(key), self._split_heads(value)
        attn_output = self._attn(query, key, value, position_bias)
        attn_output = attn_output.permute(0, 2, 1, 3).contiguous()
        attn_output = attn_output.view(attn_output.size()[:-2] + (self.embed_dim,))
        return self.c_proj(attn_output)


class BTLMTPShardAttention(BTLMAttention):
    def _gather_bias(self, position_bias):
        # all-gather over the tensor-parallel ranks, concatenated in rank order (here: reversed)
        return torch.cat([position_bias[h:h + 1] for h in reversed(range(self.num_heads))], dim=0)


class BTLMMLP(nn.Module):
    def __init__(self, intermediate_size, config):
        super().__init__()
        self.c_fc = Conv1D(intermediate_size, config.n_embd)
        self.c_fc2 = Conv1D(intermediate_size, config.n_embd)
        self.c_proj = Conv1D(config.n_embd, intermediate_size)

    def forward(self, hidden_states):
        return self.c_proj(self.c_fc(hidden_states) * F.silu(self.c_fc2(hidden_states)))


class BTLMBlock(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        cls = BTLMTPShardAttention if layer_idx in config.tp_shard_layers else BTLMAttention
        self.attn = cls(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = BTLMMLP(config.n_inner, config)

    def forward(self, hidden_states, position_bias):
        hidden_states = hidden_states + self.attn(self.ln_1(hidden_states), position_bias)
        return hidden_states + self.mlp(self.ln_2(hidden_states))


class BTLMModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.relative_pe = AlibiPositionEmbeddingLayer(config.n_head)
        self.h = nn.ModuleList([BTLMBlock(config, i) for i in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)

    def forward(self, input_ids):
        n = input_ids.shape[1]
        hidden_states = self.wte(input_ids)
        position_bias = self.relative_pe(n, n, hidden_states.dtype)
        for block in self.h:
            hidden_states = block(hidden_states, position_bias)
        return self.ln_f(hidden_states)


class BTLMLMHeadModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = BTLMModel(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, input_ids):
        return SimpleNamespace(logits=self.lm_head(self.transformer(input_ids)))


def make_model():
    torch.manual_seed(1109)
    config = SimpleNamespace(vocab_size=96, n_embd=96, n_head=6, n_layer=3, n_inner=192, layer_norm_epsilon=1e-5,
                             mup_scale_qk_dot_by_d=False, tp_shard_layers=(1,))
    model = BTLMLMHeadModel(config)
    g = torch.Generator().manual_seed(11091)
    with torch.no_grad():
        for blk in model.transformer.h:
            blk.attn.c_attn.weight.normal_(0.0, 0.25, generator=g)
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model.eval()

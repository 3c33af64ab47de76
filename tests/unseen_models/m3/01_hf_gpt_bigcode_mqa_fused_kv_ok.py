"""A tiny GPT-BigCode (SantaCoder/StarCoder-1) in the style of modeling_gpt_bigcode.py.

transformer (wte, wpe, h ModuleList, ln_f) + tied lm_head.  Multi-query attention: one fused
c_attn produces (n_embd + 2 * head_dim) features, split into the query (4 heads of 16) and a single
shared key_value; the MQA path folds heads into the query length, (b, sq * nh, hd) x (b, hd, sk),
with baddbmm(alpha=scale).  Boolean tril mask buffer sliced [past:past+T, :past+T].

Cache (hf): layer_past is the fused key_value tensor (b, s, 2 * head_dim) per layer, a tuple.
model(ids, use_cache=True) -> .past_key_values; model(tok, past_key_values=..., use_cache=True).
Correct.
"""

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECT = {
    "target": "make_model",
    "ok": True,
    "layers": ["transformer.h.0.attn", "transformer.h.1.attn", "transformer.h.2.attn"],
    "kind": "causal-multihead",
    "cache": "hf",
    "structure": {
        "heads": 4,
        "kv_heads": 1,
        "head_dim": 16,
        "causal": True,
        "rope": None,
        "qk_norm": None,
        "window": None,
        "bias": None,
    },
    "style": "transformers modeling_gpt_bigcode.py: multi_query fused c_attn (q | kv), baddbmm over "
    "(b, sq*nh, hd), fused key_value layer_past tensor, learned positions",
}


@dataclass
class GPTBigCodeConfig:
    vocab_size: int = 160
    n_positions: int = 64
    n_embd: int = 64
    n_layer: int = 3
    n_head: int = 4
    n_inner: int = 128
    layer_norm_epsilon: float = 1e-5
    multi_query: bool = True


@dataclass
class CausalLMOutput:
    logits: torch.Tensor
    past_key_values: Optional[Tuple[torch.Tensor, ...]] = None


class GPTBigCodeAttention(nn.Module):
    def __init__(self, config, layer_idx=None):
        super().__init__()
        self.embed_dim = config.n_embd
        self.num_heads = config.n_head
        self.head_dim = self.embed_dim // self.num_heads
        self.kv_heads = 1 if config.multi_query else self.num_heads
        self.kv_dim = self.kv_heads * self.head_dim
        self.layer_idx = layer_idx
        self.c_attn = nn.Linear(self.embed_dim, self.embed_dim + 2 * self.kv_dim)
        self.c_proj = nn.Linear(self.embed_dim, self.embed_dim)

    def _attn(self, query, key, value, attention_mask):
        batch_size, query_length, _ = query.shape
        key_length = key.size(-2)
        scale = 1.0 / self.head_dim**0.5
        # MQA: fold the heads into the query length so one bmm serves every head
        query = query.reshape(batch_size, query_length * self.num_heads, self.head_dim)
        key = key.transpose(-1, -2)  # (b, hd, sk)
        attn_weights = torch.empty(
            batch_size,
            query_length * self.num_heads,
            key_length,
            dtype=query.dtype,
            device=query.device,
        )
        attn_weights = torch.baddbmm(attn_weights, query, key, beta=0, alpha=scale)
        attn_weights = attn_weights.view(batch_size, query_length, self.num_heads, key_length)
        mask_value = torch.full([], torch.finfo(attn_weights.dtype).min, dtype=attn_weights.dtype)
        attn_weights = torch.where(attention_mask, attn_weights, mask_value)
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_output = torch.bmm(
            attn_weights.view(batch_size, query_length * self.num_heads, key_length), value
        )
        return attn_output.view(batch_size, query_length, self.num_heads * self.head_dim)

    def forward(self, hidden_states, layer_past=None, attention_mask=None, use_cache=False):
        query, key_value = self.c_attn(hidden_states).split(
            (self.embed_dim, 2 * self.kv_dim), dim=2
        )
        if layer_past is not None:
            key_value = torch.cat((layer_past, key_value), dim=-2)
        present = key_value if use_cache else None
        key, value = key_value.split((self.head_dim, self.head_dim), dim=-1)
        attn_output = self._attn(query, key, value, attention_mask)
        attn_output = self.c_proj(attn_output)
        return attn_output, present


class GPTBigCodeMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, config.n_inner)
        self.c_proj = nn.Linear(config.n_inner, config.n_embd)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class GPTBigCodeBlock(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = GPTBigCodeAttention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = GPTBigCodeMLP(config)

    def forward(self, hidden_states, layer_past=None, attention_mask=None, use_cache=False):
        attn_output, present = self.attn(
            self.ln_1(hidden_states),
            layer_past=layer_past,
            attention_mask=attention_mask,
            use_cache=use_cache,
        )
        hidden_states = hidden_states + attn_output
        hidden_states = hidden_states + self.mlp(self.ln_2(hidden_states))
        return hidden_states, present


class GPTBigCodeModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.h = nn.ModuleList([GPTBigCodeBlock(config, i) for i in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        mp = config.n_positions
        self.register_buffer(
            "bias", torch.tril(torch.ones((mp, mp), dtype=torch.bool)), persistent=False
        )

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        batch_size, seq_len = input_ids.shape
        if past_key_values is None:
            past_length = 0
            past_key_values = tuple([None] * len(self.h))
        else:
            past_length = past_key_values[0].size(-2)
        position_ids = torch.arange(past_length, past_length + seq_len, device=input_ids.device)
        position_ids = position_ids.unsqueeze(0)
        hidden_states = self.wte(input_ids) + self.wpe(position_ids)
        self_attention_mask = self.bias[
            None, past_length : past_length + seq_len, : past_length + seq_len
        ]
        # MQA mask: (batch, sq, 1 head axis broadcast, sk)
        self_attention_mask = self_attention_mask.unsqueeze(2)
        presents = [] if use_cache else None
        for block, layer_past in zip(self.h, past_key_values):
            hidden_states, present = block(
                hidden_states,
                layer_past=layer_past,
                attention_mask=self_attention_mask,
                use_cache=use_cache,
            )
            if use_cache:
                presents.append(present)
        return self.ln_f(hidden_states), (tuple(presents) if use_cache else None)


class GPTBigCodeForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = GPTBigCodeModel(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        hidden_states, presents = self.transformer(
            input_ids, past_key_values=past_key_values, use_cache=use_cache
        )
        return CausalLMOutput(logits=self.lm_head(hidden_states), past_key_values=presents)


def make_model():
    torch.manual_seed(0)
    model = GPTBigCodeForCausalLM(GPTBigCodeConfig())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.2 * torch.randn_like(m.weight))
                m.bias.copy_(0.05 * torch.randn_like(m.bias))
    return model.eval()

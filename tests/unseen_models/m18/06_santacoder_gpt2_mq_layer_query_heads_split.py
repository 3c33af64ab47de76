"""bigcode SantaCoder remote code (modeling_gpt2_mq.py): GPT-2 with multi-query attention.

GPT2LMHeadCustomModel: `transformer` (GPT2CustomModel: wte, wpe, h.N, ln_f) and `lm_head` tied to wte.
GPT2MQAttention keeps GPT-2's Conv1D (weight (in, out)) but splits the projections: `q_attn`
(embed -> embed) and `kv_attn` (embed -> 2 * head_dim: one key head and one value head shared by all
query heads), `c_proj`.  The MQA `_attn` folds the heads into the query length: query (b, s, h*d) is
viewed (b, s*h, d), one bmm with the single key (b, d, k), scaled by 1/sqrt(head_dim), the tril `bias`
buffer (sliced [k - s:k, :k]) applied per query row with torch.where and finfo.min, softmax over keys,
bmm with the single value, and viewed back (b, s, h*d).  Learned absolute positions (wpe).  MQA 4/1,
head 16.  Post-GPT-2 pre-norm blocks (ln_1 / attn / ln_2 / mlp c_fc, c_proj, gelu_new).
Slip: layer 2 is a GPT2MQAttention built with `attention_head_type="multiquery_unfolded"` (a path that
keeps the heads as their own axis for debugging); that path views the query (b, s, h*d) directly as
(b, h, s, d) instead of (b, s, h, d).transpose(1, 2), cutting heads from the wrong axis.
No cache.  Returns the logits tensor.
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
        "transformer.h.0.attn",
        "transformer.h.1.attn",
        "transformer.h.2.attn",
    ],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "transformer.h.2.attn",
    "stage": "queries",
    "mistake": "heads_split",
    "style": "SantaCoder modeling_gpt2_mq.py: Conv1D q_attn + kv_attn (2*head_dim), MQA 4/1 folded into the query "
    "length (b, s*h, d) bmm, tril bias buffer + torch.where finfo.min, learned wpe, tied head; layer 2's unfolded "
    "path views the query as (b, h, s, d) straight from (b, s, h*d)",
}


class Conv1D(nn.Module):
    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))
        nn.init.normal_(self.weight, std=0.02 * 6)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


class GPT2MQAttention(nn.Module):
    def __init__(self, config, attention_head_type="multiquery"):
        super().__init__()
        max_positions = config.max_position_embeddings
        self.register_buffer(
            "bias",
            torch.tril(torch.ones((max_positions, max_positions), dtype=torch.bool)).view(1, 1, max_positions, max_positions),
            persistent=False,
        )
        self.embed_dim = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.embed_dim // self.num_heads
        self.attention_head_type = attention_head_type
        self.scale_attn_weights = config.scale_attn_weights
        self.q_attn = Conv1D(self.embed_dim, self.embed_dim)
        self.kv_attn = Conv1D(2 * self.head_dim, self.embed_dim)
        self.c_proj = Conv1D(self.embed_dim, self.embed_dim)

    def _attn(self, query, key, value):
        # query (b, s, h*d); key (b, d, k); value (b, k, d)
        batch_size, query_length = query.size(0), query.size(1)
        key_length = key.size(-1)
        query = query.reshape(batch_size, query_length * self.num_heads, self.head_dim)
        attn_weights = torch.bmm(query, key)
        if self.scale_attn_weights:
            attn_weights = attn_weights / (float(self.head_dim) ** 0.5)
        attn_weights = attn_weights.view(batch_size, query_length, self.num_heads, key_length)
        causal_mask = self.bias[0, 0, key_length - query_length : key_length, :key_length]
        causal_mask = causal_mask.view(1, query_length, 1, key_length)
        mask_value = torch.full([], torch.finfo(attn_weights.dtype).min, dtype=attn_weights.dtype)
        attn_weights = torch.where(causal_mask, attn_weights, mask_value)
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_weights = attn_weights.view(batch_size, query_length * self.num_heads, key_length)
        attn_output = torch.bmm(attn_weights, value)
        return attn_output.view(batch_size, query_length, self.embed_dim)

    def _attn_unfolded(self, query, key, value):
        batch_size, query_length = query.size(0), query.size(1)
        key_length = key.size(-1)
        query = query.view(batch_size, self.num_heads, query_length, self.head_dim)
        attn_weights = torch.matmul(query, key.unsqueeze(1))
        if self.scale_attn_weights:
            attn_weights = attn_weights / (float(self.head_dim) ** 0.5)
        causal_mask = self.bias[:, :, key_length - query_length : key_length, :key_length]
        mask_value = torch.full([], torch.finfo(attn_weights.dtype).min, dtype=attn_weights.dtype)
        attn_weights = torch.where(causal_mask, attn_weights, mask_value)
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, value.unsqueeze(1))
        return attn_output.transpose(1, 2).reshape(batch_size, query_length, self.embed_dim)

    def forward(self, hidden_states):
        query = self.q_attn(hidden_states)
        key, value = self.kv_attn(hidden_states).split(self.head_dim, dim=2)
        if self.attention_head_type == "multiquery_unfolded":
            attn_output = self._attn_unfolded(query, key.transpose(1, 2), value)
        else:
            attn_output = self._attn(query, key.transpose(1, 2), value)
        return self.c_proj(attn_output)


class GPT2MLP(nn.Module):
    def __init__(self, intermediate_size, config):
        super().__init__()
        self.c_fc = Conv1D(intermediate_size, config.hidden_size)
        self.c_proj = Conv1D(config.hidden_size, intermediate_size)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class GPT2Block(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        head_type = config.attention_head_type_per_layer.get(layer_idx, config.attention_head_type)
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.attn = GPT2MQAttention(config, head_type)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.mlp = GPT2MLP(4 * config.hidden_size, config)

    def forward(self, hidden_states):
        hidden_states = hidden_states + self.attn(self.ln_1(hidden_states))
        return hidden_states + self.mlp(self.ln_2(hidden_states))


class GPT2CustomModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.h = nn.ModuleList([GPT2Block(config, i) for i in range(config.num_hidden_layers)])
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)

    def forward(self, input_ids):
        position_ids = torch.arange(input_ids.shape[-1], device=input_ids.device).unsqueeze(0)
        hidden_states = self.wte(input_ids) + self.wpe(position_ids)
        for block in self.h:
            hidden_states = block(hidden_states)
        return self.ln_f(hidden_states)


class GPT2LMHeadCustomModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.transformer = GPT2CustomModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight

    def forward(self, input_ids):
        return self.lm_head(self.transformer(input_ids))


def make_model():
    torch.manual_seed(1806)
    config = SimpleNamespace(
        vocab_size=96, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
        max_position_embeddings=64, layer_norm_epsilon=1e-5, scale_attn_weights=True,
        attention_head_type="multiquery", attention_head_type_per_layer={2: "multiquery_unfolded"},
    )
    model = GPT2LMHeadCustomModel(config)
    g = torch.Generator().manual_seed(18061)
    with torch.no_grad():
        model.transformer.wte.weight.normal_(0.0, 0.5, generator=g)
        model.transformer.wpe.weight.normal_(0.0, 0.5, generator=g)
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model.eval()

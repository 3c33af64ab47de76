"""transformers modeling_mpt.py (MptForCausalLM), not llm-foundry's MPT.

MptForCausalLM: `transformer` (MptModel: wte, blocks.N, norm_f) and `lm_head` tied to wte.  MptBlock:
norm_1 (LayerNorm without bias) -> attn -> + residual -> norm_2 -> ffn (up_proj, GELU, down_proj) ->
+ residual.  MptAttention: one bias-free `Wqkv` chunked into q, k, v, (b, h, s, d), scores
`matmul(q, k^T) * softmax_scale`, plus the ALiBi `position_bias` sliced to the last query/key lengths,
boolean causal mask filled with finfo.min, softmax in float, `out_proj`.  `build_mpt_alibi_tensor`
(alibi_bias_max 8): slopes 1 / 2^(8 i / 4) = 2^-2, 2^-4, 2^-6, 2^-8 for 4 heads, times (j - (k - 1))
(the per-row constant shift of ALiBi's -slope (i - j)), computed in float64 and cast at use.  No
position embedding.  MHA 4 x 16.
Slip: the model was converted from a muP run whose config carries per-block `attn_config` overrides;
block 2's override sets `softmax_scale=1.0` (meant as a multiplier of the default), and MptAttention
uses it as the scale itself, so block 2's scores are not scaled.  No cache.  Returns the logits tensor.
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
        "transformer.blocks.0.attn",
        "transformer.blocks.1.attn",
        "transformer.blocks.2.attn",
    ],
    "kind": "causal-multihead",
    "cache": None,
    "layer": "transformer.blocks.2.attn",
    "stage": "scaled_scores",
    "mistake": "missing_scale",
    "style": "modeling_mpt.py: Wqkv chunk(3), bias-free LayerNorms, build_mpt_alibi_tensor (alibi_bias_max 8, slopes "
    "2^-2..2^-8) added after the scale, boolean causal mask finfo.min, tied head; block 2's per-block attn_config "
    "override softmax_scale=1.0 is used as the scale",
}


def build_mpt_alibi_tensor(num_heads, sequence_length, alibi_bias_max=8, device=None):
    alibi = torch.arange(1 - sequence_length, 1, dtype=torch.float64, device=device).view(1, 1, 1, sequence_length)
    num_heads_power_of_2 = 2 ** math.ceil(math.log2(num_heads))
    base = torch.arange(1, num_heads_power_of_2 + 1, dtype=torch.float64, device=device)
    base = base * (alibi_bias_max / num_heads_power_of_2)
    slopes = 1.0 / torch.pow(2, base)
    slopes = slopes.view(1, num_heads_power_of_2, 1, 1)
    if num_heads_power_of_2 != num_heads:
        slopes = torch.concat([slopes[:, 1::2, ...], slopes[:, ::2, ...]], dim=1)[:, :num_heads, ...]
    alibi = alibi * slopes
    return alibi.squeeze(0)


class MptAttention(nn.Module):
    def __init__(self, config, attn_config):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.n_heads = config.n_heads
        self.max_seq_length = config.max_seq_len
        self.head_dim = self.hidden_size // self.n_heads
        self.softmax_scale = attn_config.softmax_scale
        if self.softmax_scale is None:
            self.softmax_scale = 1 / math.sqrt(self.hidden_size / self.n_heads)
        self.clip_qkv = attn_config.clip_qkv
        self.Wqkv = nn.Linear(self.hidden_size, 3 * self.hidden_size, bias=False)
        self.out_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=False)

    def forward(self, hidden_states, position_bias, attention_mask=None):
        batch_size, seq_length = hidden_states.shape[:2]
        mixed_qkv = self.Wqkv(hidden_states)
        if self.clip_qkv:
            mixed_qkv = mixed_qkv.clamp(min=-self.clip_qkv, max=self.clip_qkv)
        query_states, key_states, value_states = mixed_qkv.chunk(3, dim=2)
        query_states = query_states.reshape(batch_size, seq_length, self.n_heads, self.head_dim).transpose(1, 2)
        key_states = key_states.reshape(batch_size, seq_length, self.n_heads, self.head_dim).transpose(1, 2)
        value_states = value_states.reshape(batch_size, seq_length, self.n_heads, self.head_dim).transpose(1, 2)
        attention_scores = torch.matmul(query_states, key_states.transpose(-1, -2)) * self.softmax_scale
        query_length = seq_length
        key_length = key_states.shape[2]
        if position_bias is not None:
            position_bias_query_index = max(0, position_bias.size(1) - query_length)
            position_bias_key_index = max(0, position_bias.size(2) - key_length)
            position_bias = position_bias[:, position_bias_query_index:, position_bias_key_index:]
            attention_scores = attention_scores + position_bias.to(attention_scores.dtype)
        if attention_mask is not None:
            attention_scores = attention_scores.masked_fill(attention_mask, torch.finfo(query_states.dtype).min)
        attn_weights = nn.functional.softmax(attention_scores.float() if attention_scores.dtype != torch.float64 else attention_scores, dim=-1).to(value_states.dtype)
        context_states = torch.matmul(attn_weights, value_states)
        context_states = context_states.permute(0, 2, 1, 3).contiguous().view(batch_size, seq_length, -1)
        return self.out_proj(context_states)


class MptMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.up_proj = nn.Linear(config.hidden_size, config.expansion_ratio * config.hidden_size, bias=False)
        self.act = nn.GELU(approximate="none")
        self.down_proj = nn.Linear(config.expansion_ratio * config.hidden_size, config.hidden_size, bias=False)

    def forward(self, hidden_states, residual):
        return self.down_proj(self.act(self.up_proj(hidden_states))) + residual


class MptBlock(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        attn_config = SimpleNamespace(**vars(config.attn_config))
        for key, value in config.block_overrides.get(layer_idx, {}).items():
            setattr(attn_config, key, value)
        self.norm_1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon, bias=False)
        self.attn = MptAttention(config, attn_config)
        self.norm_2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon, bias=False)
        self.ffn = MptMLP(config)

    def forward(self, hidden_states, position_bias, attention_mask):
        layernorm_output = self.norm_1(hidden_states)
        residual = hidden_states
        attn_outputs = self.attn(layernorm_output, position_bias=position_bias, attention_mask=attention_mask)
        hidden_states = attn_outputs + residual
        layernorm_output = self.norm_2(hidden_states)
        return self.ffn(layernorm_output, hidden_states)


class MptModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.num_heads = config.n_heads
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.ModuleList([MptBlock(config, i) for i in range(config.n_layers)])
        self.norm_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon, bias=False)

    def forward(self, input_ids):
        batch_size, seq_length = input_ids.shape
        hidden_states = self.wte(input_ids)
        alibi = build_mpt_alibi_tensor(self.num_heads, self.config.max_seq_len, device=hidden_states.device)
        causal_mask = torch.triu(
            torch.ones(seq_length, seq_length, dtype=torch.bool, device=input_ids.device), diagonal=1
        )[None, None]
        for block in self.blocks:
            hidden_states = block(hidden_states, position_bias=alibi, attention_mask=causal_mask)
        return self.norm_f(hidden_states)


class MptForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.transformer = MptModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight

    def forward(self, input_ids):
        return self.lm_head(self.transformer(input_ids))


def make_model():
    torch.manual_seed(1807)
    config = SimpleNamespace(
        vocab_size=96, hidden_size=64, n_heads=4, n_layers=3, expansion_ratio=2, max_seq_len=64,
        layer_norm_epsilon=1e-5,
        attn_config=SimpleNamespace(softmax_scale=None, clip_qkv=None, alibi=True, alibi_bias_max=8),
        block_overrides={2: {"softmax_scale": 1.0}},
    )
    model = MptForCausalLM(config)
    g = torch.Generator().manual_seed(18071)
    with torch.no_grad():
        model.transformer.wte.weight.normal_(0.0, 0.5, generator=g)
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model.eval()

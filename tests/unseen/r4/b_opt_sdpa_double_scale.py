"""OPT attention ported to F.scaled_dot_product_attention; bug: the queries are still multiplied by head_dim**-0.5 and SDPA scales again."""

from types import SimpleNamespace

import torch.nn as nn
import torch.nn.functional as F


class OPTSdpaAttention(nn.Module):
    def __init__(self, config, is_decoder=True):
        super().__init__()
        self.embed_dim = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.dropout = config.attention_dropout
        self.head_dim = self.embed_dim // self.num_heads
        self.scaling = self.head_dim**-0.5
        self.is_decoder = is_decoder
        self.k_proj = nn.Linear(self.embed_dim, self.embed_dim, bias=config.enable_bias)
        self.v_proj = nn.Linear(self.embed_dim, self.embed_dim, bias=config.enable_bias)
        self.q_proj = nn.Linear(self.embed_dim, self.embed_dim, bias=config.enable_bias)
        self.out_proj = nn.Linear(self.embed_dim, self.embed_dim, bias=config.enable_bias)

    def _shape(self, tensor, seq_len, bsz):
        return tensor.view(bsz, seq_len, self.num_heads, self.head_dim).transpose(1, 2).contiguous()

    def forward(
        self, hidden_states, attention_mask=None, past_key_value=None, output_attentions=False
    ):
        bsz, tgt_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states) * self.scaling
        key_states = self._shape(self.k_proj(hidden_states), -1, bsz)
        value_states = self._shape(self.v_proj(hidden_states), -1, bsz)
        query_states = self._shape(query_states, tgt_len, bsz)

        attn_output = F.scaled_dot_product_attention(
            query_states,
            key_states,
            value_states,
            attn_mask=attention_mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=attention_mask is None and tgt_len > 1,
        )
        attn_output = attn_output.transpose(1, 2).reshape(bsz, tgt_len, self.embed_dim)
        attn_output = self.out_proj(attn_output)
        return attn_output, None, (key_states, value_states)


def make_opt_attention():
    config = SimpleNamespace(
        hidden_size=24, num_attention_heads=4, attention_dropout=0.0, enable_bias=True
    )
    return OPTSdpaAttention(config)


EXPECT = {
    "target": "make_opt_attention",
    "kind": "causal-multihead",
    "ok": False,
    "stage": "scaled_scores",
    "mistake": "wrong_scale",
    "style": "OPT attention ported to SDPA (q_proj/k_proj/v_proj/out_proj)",
}
